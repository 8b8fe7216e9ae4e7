"""Secrets in the config are typed as such, so no view of the config shows them (issue 23).

Tokens (peers.*.token, worker.token), API keys, models' env values and the option maps handed to
plugins (a strategy's, a GPU reader's) show as `**********` in /admin/config, in a reload's
report and in the log, while the code that needs them (auth, peer requests, children, plugins)
still gets the real values. The schema test guards the next secret field: one named like a
secret that is not typed as one fails here, rather than showing in clear."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_gpu import write_gpus
from pydantic import SecretStr

from corral.supervisor.config import MASK, ConfigError, LoadedConfig, SecretOptions, parse_config
from corral.supervisor.config.schema import Config
from corral.supervisor.reload import ReloadAttempt, config_view, diff
from corral.supervisor.runtime import build_runtime

from conftest import REPO, CorralFactory, tiny_config

FAKE_GPU = Path(__file__).with_name("fake_gpu.py")
STRATEGY = REPO / "presets" / "contrib" / "biggest_first.py"

PEER_TOKEN = "peer-token-from-env-1f3a"
WORKER_TOKEN = "worker-token-77c2"
USER_KEY = "user-key-9d41"
ADMIN_KEY = "admin-key-c0de"
HF_TOKEN = "hf-env-value-5e6b"
STRATEGY_SECRET = "strategy-option-secret-a8a8"
READER_SECRET = "reader-option-secret-b9b9"
SECRETS = (PEER_TOKEN, WORKER_TOKEN, USER_KEY, ADMIN_KEY, HF_TOKEN, STRATEGY_SECRET,
           READER_SECRET)


def secret_config(gpus: Path, model: str = "a.gguf", suffix: str = "") -> dict[str, Any]:
    """A config with every kind of secret; `suffix` changes every secret value."""
    return {
        "api_keys": [USER_KEY + suffix],
        "admin_api_keys": [ADMIN_KEY + suffix],
        "peers": {"box2": {"url": "http://127.0.0.1:9", "token": "${CORRAL_TEST_PEER_TOKEN}"
                           + suffix}},
        "worker": {"token": WORKER_TOKEN + suffix},
        "policy": {"strategy": f"plugin:{STRATEGY}:BiggestFirst",
                   "options": {"big_model_bytes": 1, "api_key": STRATEGY_SECRET + suffix}},
        "memory": {"gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpus),
                                          "token": READER_SECRET + suffix}},
        "models": {"a": {"model": model, "env": {"HF_TOKEN": HF_TOKEN + suffix}}},
    }


def in_clear(text: str, secrets: tuple[str, ...] = SECRETS) -> list[str]:
    return [s for s in secrets if s in text]


@pytest.fixture
def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LoadedConfig:
    monkeypatch.setenv("CORRAL_TEST_PEER_TOKEN", PEER_TOKEN)
    gpus = tmp_path / "gpus.json"
    write_gpus(gpus, {"gpu0": (8000, 0)})
    return parse_config(yaml.safe_dump(secret_config(gpus)), tmp_path / "corral.yaml")


def test_config_view_shows_no_secret_value(loaded: LoadedConfig) -> None:
    view = config_view(loaded)
    assert in_clear(json.dumps(view)) == []
    config = view["config"]
    assert config["api_keys"] == [MASK] and config["admin_api_keys"] == [MASK]
    assert config["peers"]["box2"] == {"url": "http://127.0.0.1:9", "token": MASK}
    assert config["worker"]["token"] == MASK
    assert config["models"]["a"]["env"] == {"HF_TOKEN": MASK}
    # A plugin's options show which keys are set, none of the values.
    assert config["policy"]["options"] == {"big_model_bytes": MASK, "api_key": MASK}
    assert config["memory"]["gpu_reader_options"] == {"path": MASK, "token": MASK}


def test_the_code_that_needs_a_secret_still_gets_its_value(loaded: LoadedConfig) -> None:
    config = loaded.config
    assert config.peers["box2"].token.get_secret_value() == PEER_TOKEN  # ${VAR} expanded
    assert config.worker.token is not None
    assert config.worker.token.get_secret_value() == WORKER_TOKEN
    assert [k.get_secret_value() for k in config.api_keys] == [USER_KEY]
    assert loaded.models["a"].env == {"HF_TOKEN": HF_TOKEN}  # what the child is given
    runtime = build_runtime(loaded)
    assert runtime.strategy.options["api_key"] == STRATEGY_SECRET  # what the plugin is given
    assert config.memory.gpu_reader_options.get_secret_value()["token"] == READER_SECRET
    assert runtime.gpu_reader.path == Path(  # type: ignore[attr-defined]
        config.memory.gpu_reader_options.get_secret_value()["path"])


def test_reprs_and_str_hide_secrets(loaded: LoadedConfig) -> None:
    # What a log line would show of the config, a spec or a peer.
    for shown in (repr(loaded.config), str(loaded.config), repr(loaded.models["a"]),
                  repr(loaded.config.peers), repr(loaded), f"{loaded.config.worker.token}"):
        assert in_clear(shown) == [], shown


def test_a_reload_names_the_changed_secrets_never_their_values(
        loaded: LoadedConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = tmp_path / "gpus.json"
    changed = parse_config(yaml.safe_dump(secret_config(gpus, suffix="-new")),
                           tmp_path / "corral.yaml")
    plan = diff(loaded, changed)
    assert set(plan.settings) == {"api_keys", "admin_api_keys", "peers", "worker", "policy",
                                  "memory"}
    assert [(c.name, c.fields) for c in plan.replace] == [("a", ("env",))]
    report = json.dumps(ReloadAttempt.applied("admin", 0.0, plan, changed).as_dict())
    assert in_clear(report, SECRETS + tuple(s + "-new" for s in SECRETS)) == [], report
    assert diff(loaded, loaded).empty  # equal secrets compare equal: nothing to do


def test_a_refused_secret_is_not_quoted_in_the_error(tmp_path: Path) -> None:
    text = yaml.safe_dump({"peers": {"box2": {"url": "http://x", "token": [PEER_TOKEN]}},
                           "api_keys": [{"key": USER_KEY}]})
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert {i.key for i in caught.value.issues} == {"peers.box2.token", "api_keys[0]"}
    # The pydantic error it chains, as a traceback in a log would print it, quotes nothing.
    assert in_clear(str(caught.value)) == [] and in_clear(str(caught.value.__cause__)) == []


def _secret_properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(dotted name, property schema) of every property of every model in the schema."""
    out = []
    for model, body in {"Config": schema, **schema.get("$defs", {})}.items():
        for name, prop in body.get("properties", {}).items():
            out.append((f"{model}.{name}", prop))
    return out


def _is_secret(prop: dict[str, Any]) -> bool:
    """A secret, a list or map of secrets, or an optional one."""
    if prop.get("writeOnly"):
        return True
    if "anyOf" in prop:
        return all(_is_secret(p) or p.get("type") == "null" for p in prop["anyOf"])
    inner = prop.get("items", prop.get("additionalProperties"))
    return isinstance(inner, dict) and _is_secret(inner)


def test_every_field_named_like_a_secret_is_typed_as_one() -> None:
    """The guard for the next one: a token, key, password or plugin options field added to the
    schema as a plain str or dict would show in clear, so it fails here instead."""
    props = _secret_properties(Config.model_json_schema())
    # Named like a secret: a field that is (or ends in) a token, key, secret, password or
    # plugin options; not one that counts tokens (prompt_cache.min_tokens).
    secret_name = re.compile(r"(^|_)(token|keys?|secret|password|options)$")
    named = [(name, prop) for name, prop in props
             if secret_name.search(name.rsplit(".", 1)[1].lower()) or name.endswith(".env")]
    assert {name for name, _ in named} >= {
        "Config.api_keys", "Config.admin_api_keys", "PeerConfig.token", "WorkerConfig.token",
        "PolicyConfig.options", "MemoryConfig.gpu_reader_options", "ModelConfig.env",
        "ModelConfig.api_key"}
    assert [name for name, prop in named if not _is_secret(prop)] == []
    assert SecretOptions({"a": 1}) == SecretOptions({"a": 1}) != SecretOptions({"a": 2})
    assert SecretStr("x") == SecretStr("x")


def test_a_running_corral_serves_its_config_without_a_secret(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.json"
    write_gpus(gpus, {"gpu0": (8000, 0)})
    config = tiny_config(tiny_models, **secret_config(gpus, model=str(tiny_models["tiny-a"])))
    path = tmp_path / "secrets.yaml"
    path.write_text(yaml.safe_dump(config))
    corral = start_corral.serve(path, api_key=ADMIN_KEY,
                                env={"CORRAL_TEST_PEER_TOKEN": PEER_TOKEN})
    resp = corral.http.get("/admin/config")
    assert resp.status_code == 200, resp.text
    assert in_clear(resp.text) == [], resp.text
    shown = resp.json()["active"]["config"]
    assert shown["peers"]["box2"]["token"] == MASK and shown["worker"]["token"] == MASK
    # The keys still work: the daemon has their values.
    assert httpx.get(corral.url + "/admin/config").status_code == 401
    assert httpx.get(corral.url + "/v1/models",
                     headers={"Authorization": f"Bearer {USER_KEY}"}).status_code == 200

    # A reload that changes every secret reports which settings changed, no value.
    new = tiny_config(tiny_models, **secret_config(gpus, model=str(tiny_models["tiny-a"]),
                                                   suffix="-new"))
    new["admin_api_keys"] = [ADMIN_KEY]  # the key this client sends
    path.write_text(yaml.safe_dump(new))
    reloaded = corral.http.post("/admin/reload")
    assert reloaded.status_code == 200, reloaded.text
    assert {"api_keys", "peers", "worker", "policy", "memory"} <= set(
        reloaded.json()["changes"]["settings"])
    everything = SECRETS + tuple(s + "-new" for s in SECRETS)
    assert in_clear(reloaded.text, everything) == [], reloaded.text
    assert in_clear(corral.http.get("/admin/config").text, everything) == []
    assert corral.log_events("daemon.reload")  # the reload was logged...
    assert in_clear(corral.log_path.read_text(), everything) == []  # ...and nothing in clear

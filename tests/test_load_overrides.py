"""Admin load overrides (docs/api.md): POST /admin/models/<m>/load {"ctx": ..., ...} sets one
start's context, KV cache types, slots and draft settings within the bounds the config sets;
the child runs them (its argv says so), /admin/models shows them, a later plain load runs the
config again; anything out of bounds or unknown is a 400 naming the field before anything
starts; a model up with other settings is refused (409) unless the load asks to restart it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import Corral, CorralFactory, wait_until
from tinymodel import write_tiny_llama


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tmp_path_factory: pytest.TempPathFactory,
           tiny_models: dict[str, Path]) -> Corral:
    # Heads of 32 dims: quantized KV types (blocks of 32) run on it.
    tiny = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", 1, n_head=2))
    return start_corral_module({
        "defaults": {"ctx": 1024, "prompt_cache": False},
        "policy": {"max_loaded": 2},
        "models": {
            "tiny": {"model": tiny},
            # Its own draft (same vocabulary): draft settings mean something for it.
            "drafty": {"model": tiny, "args": ["--model-draft", tiny],
                       "load_overrides": {"max_ctx": 4096, "cache_types": ["f16", "q8_0"],
                                          "max_parallel": 4, "max_draft": 6}},
            # Heads of 16 dims: no quantized KV cache.
            "narrow": {"model": str(tiny_models["tiny-b"])},
        },
    })


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def load(corral: Corral, name: str, body: dict[str, Any] | None = None) -> Any:
    return corral.http.post(f"/admin/models/{name}/load", json=body) if body is not None \
        else corral.http.post(f"/admin/models/{name}/load")


def unload(corral: Corral, name: str) -> None:
    assert corral.http.post(f"/admin/models/{name}/unload?force=1").status_code == 200
    wait_until(lambda: corral.model(name)["state"] == "stopped")


def test_a_load_with_overrides_starts_the_child_with_them_and_only_that_start(corral: Corral):
    answer = load(corral, "tiny", {"ctx": 4096, "cache_type_k": "q8_0", "parallel": 2})
    assert answer.status_code == 200, answer.text
    shown = answer.json()
    assert shown["state"] == "ready"
    assert shown["overrides"] == {"ctx": 4096, "cache_type_k": "q8_0", "parallel": 2}
    assert (shown["ctx"], shown["parallel"], shown["cache_type_k"]) == (4096, 2, "q8_0")
    argv = argv_of(shown["pid"])
    assert flag(argv, "--ctx-size") == "4096"
    assert flag(argv, "--cache-type-k") == "q8_0"
    assert flag(argv, "--parallel") == "2"
    assert corral.model("tiny")["overrides"] == shown["overrides"]  # GET /admin/models too
    # Two slots in corral too: two requests run at once.
    client = corral.client()
    for _ in range(2):
        client.chat.completions.create(model="tiny", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    unload(corral, "tiny")
    assert corral.model("tiny")["overrides"] is None

    plain = load(corral, "tiny")
    assert plain.status_code == 200, plain.text
    argv = argv_of(plain.json()["pid"])
    assert flag(argv, "--ctx-size") == "1024" and flag(argv, "--parallel") == "1"
    assert flag(argv, "--cache-type-k") is None
    assert plain.json()["overrides"] is None and plain.json()["ctx"] == 1024
    unload(corral, "tiny")


def test_a_running_model_with_other_settings_is_refused_unless_restarted(corral: Corral):
    assert load(corral, "tiny").status_code == 200
    pid = corral.model("tiny")["pid"]
    # The settings it runs already: nothing to do.
    assert load(corral, "tiny", {"ctx": 1024}).status_code == 200
    assert corral.model("tiny")["pid"] == pid
    refused = load(corral, "tiny", {"ctx": 2048})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "settings_differ" and "restart" in error["message"]
    assert corral.model("tiny")["pid"] == pid  # untouched

    restarted = load(corral, "tiny", {"ctx": 2048, "restart": True})
    assert restarted.status_code == 200, restarted.text
    shown = restarted.json()
    assert shown["pid"] != pid and shown["overrides"] == {"ctx": 2048}
    assert flag(argv_of(shown["pid"]), "--ctx-size") == "2048"
    # A plain load with restart: the config again.
    back = load(corral, "tiny", {"restart": True}).json()
    assert back["overrides"] is None and flag(argv_of(back["pid"]), "--ctx-size") == "1024"
    unload(corral, "tiny")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"ctx": 0}, "ctx", "out of bounds"),
    ({"ctx": 40000}, "ctx", "trained context"),  # tiny-a was trained on 32768
    ({"ctx": "4096"}, "ctx", "integer"),
    ({"cache_type_k": "q9_0"}, "cache_type_k", "not allowed"),
    ({"cache_type_v": "q8_0", "_model": "narrow"}, "cache_type_v", "blocks of 32"),
    ({"parallel": 17}, "parallel", "max_parallel"),
    ({"draft_max": 4}, "draft_max", "no draft model"),
    ({"n_gpu_layers": 0}, "n_gpu_layers", "unknown field"),
    ({"ctx": 2048, "restart": "yes"}, "restart", "true or false"),
])
def test_bad_overrides_are_400_naming_the_field_and_start_nothing(corral: Corral, body, param,
                                                                 words):
    body = dict(body)
    model = body.pop("_model", "tiny")
    answer = load(corral, model, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert corral.model(model)["state"] == "stopped"


def test_the_configs_bounds_and_draft_settings(corral: Corral):
    for body, param in (({"ctx": 8192}, "ctx"), ({"cache_type_k": "q4_0"}, "cache_type_k"),
                        ({"parallel": 5}, "parallel"), ({"draft_max": 7}, "draft_max"),
                        ({"draft_max": 3, "draft_min": 4}, "draft_min")):
        answer = load(corral, "drafty", body)
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, param), body
    answer = load(corral, "drafty", {"ctx": 4096, "draft_max": 5, "draft_min": 1})
    assert answer.status_code == 200, answer.text
    shown = answer.json()
    assert (shown["draft_max"], shown["draft_min"]) == (5, 1)
    argv = argv_of(shown["pid"])
    # llama.cpp's name for it, as this build's --help lists it (--draft-max before).
    assert "5" in (flag(argv, "--spec-draft-n-max"), flag(argv, "--draft-max"))
    assert "1" in (flag(argv, "--spec-draft-n-min"), flag(argv, "--draft-min"))
    assert flag(argv, "--ctx-size") == "4096"
    unload(corral, "drafty")

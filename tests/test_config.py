"""Config validation: precise errors with file, line and key; `corral check` exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from corral.supervisor.config import ConfigError, load_config, parse_config

GOOD = """\
listen: 127.0.0.1:9000
defaults: {ttl: 60, ctx: 1024}
policy: {max_loaded: 2}
models:
  smol:
    model: ./models/smol.gguf
    aliases: [default]
    ttl: 600
    parallel: 2
    cache_type_k: q8_0
    args: ["--flash-attn", "auto"]
"""


def _issues(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "corral.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return [str(i) for i in err.value.issues]


def test_good_config_resolves_defaults_and_paths(tmp_path):
    path = tmp_path / "corral.yaml"
    path.write_text(GOOD)
    loaded = load_config(path)
    smol = loaded.models["smol"]
    assert smol.model_path == tmp_path / "models" / "smol.gguf"
    assert (smol.ttl, smol.ctx, smol.parallel, smol.cache_type_k) == (600, 1024, 2, "q8_0")
    assert smol.args == ("--flash-attn", "auto")
    assert loaded.aliases == {"default": "smol"}


def test_unknown_key_is_an_error_with_line(tmp_path):
    issues = _issues(GOOD.replace("    ttl: 600", "    tll: 600"), tmp_path)
    assert issues == [f"{tmp_path / 'corral.yaml'}:8: models.smol.tll: "
                      "Extra inputs are not permitted"]


def test_every_error_is_reported_at_once(tmp_path):
    text = GOOD.replace("max_loaded: 2", "max_loaded: 0").replace("cache_type_k: q8_0",
                                                                  "cache_type_k: q9")
    issues = _issues(text, tmp_path)
    assert len(issues) == 2
    assert any(":3: policy.max_loaded:" in i for i in issues)
    assert any(":10: models.smol.cache_type_k:" in i and "q8_0" in i for i in issues)


def test_bad_yaml_points_at_the_line(tmp_path):
    issues = _issues("models:\n  smol:\n    model: [unclosed\n", tmp_path)
    assert len(issues) == 1 and "invalid YAML" in issues[0]
    assert issues[0].startswith(f"{tmp_path / 'corral.yaml'}:4")


def test_duplicate_alias_and_alias_shadowing_a_model(tmp_path):
    text = GOOD + "  other:\n    model: x.gguf\n    aliases: [default, smol]\n"
    issues = _issues(text, tmp_path)
    assert any(":14: models.other.aliases[0]: alias 'default' is already used by 'smol'" in i
               for i in issues)
    assert any("models.other.aliases[1]: alias 'smol' is already a model name" in i
               for i in issues)


def test_env_expansion(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_TEST_KEY", "k-123")
    loaded = parse_config("api_keys: ['${CORRAL_TEST_KEY}', '${CORRAL_UNSET:-fallback}']\n")
    assert loaded.config.api_keys == ["k-123", "fallback"]
    with pytest.raises(ConfigError, match="CORRAL_NOPE is not set"):
        parse_config("api_keys: ['${CORRAL_NOPE}']\n")


def test_models_dir_discovers_gguf_files(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "alpha.gguf").write_bytes(b"")
    (tmp_path / "m" / "notes.txt").write_text("")
    loaded = parse_config("models_dir: m\n", source=tmp_path / "c.yaml")
    assert list(loaded.models) == ["alpha"]
    assert loaded.models["alpha"].model_path == tmp_path / "m" / "alpha.gguf"
    assert loaded.models["alpha"].ctx == 4096  # the defaults


def test_corral_check_cli(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("parallel: 2", "paralel: 2"))
    ok = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", str(good)],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "ok (1 models)" in ok.stdout
    failed = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", str(bad)],
                            capture_output=True, text=True)
    assert failed.returncode == 1
    assert f"{bad}:9: models.smol.paralel: Extra inputs are not permitted" in failed.stderr


def test_serve_refuses_a_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: {max_loaded: -1}\n")
    run = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(bad)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1
    assert f"{bad}:1: policy.max_loaded" in run.stderr


def test_presets_are_valid():
    presets = sorted((Path(__file__).parent.parent / "presets").glob("*.yaml"))
    assert presets
    for preset in presets:
        load_config(preset)


GROUPS = """\
policy: {max_loaded: 3}
models:
  a: {model: a.gguf}
  b: {model: b.gguf, aliases: [bee]}
  c: {model: c.gguf}
groups:
  core:
    models: [a, bee, c]
    type: fan_out
    selector: judge
    judge: c
    fallback: replace_with
    replace_with: {a: b}
    pinned: true
    expose_as_model: true
"""


def test_good_groups_resolve_aliases_and_defaults(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(GROUPS)
    group = load_config(path).groups["core"]
    assert group.models == ("a", "b", "c")  # the alias resolved to its model
    assert group.required_responses == 1  # fan_out: one good answer to choose from
    assert group.replace_with == {"a": "b"} and group.judge == "c" and group.pinned


def test_group_errors_are_precise(tmp_path):
    text = (GROUPS.replace("models: [a, bee, c]", "models: [a, b, bee, ghost]")
            .replace("judge: c", "judge: nobody").replace("{a: b}", "{c: zed}")
            + "  think:\n    models: [a]\n    type: consensus\n")
    issues = _issues(text, tmp_path)
    where = tmp_path / "corral.yaml"
    assert f"{where}:8: groups.core.models[2]: 'bee' is listed twice" in issues
    assert any(i.startswith(f"{where}:8: groups.core.models[3]: unknown model 'ghost'")
               for i in issues)
    assert any(i.startswith(f"{where}:11: groups.core.judge: unknown model 'nobody'")
               for i in issues)
    assert any("groups.core.replace_with.c: unknown model 'zed'" in i for i in issues)
    assert f"{where}:16: groups.think.synthesizer: a consensus group needs a synthesizer model" \
        in issues


def test_group_judge_and_replace_with_must_be_given(tmp_path):
    text = GROUPS.replace("    judge: c\n", "").replace("    replace_with: {a: b}\n", "")
    issues = _issues(text, tmp_path)
    assert any("groups.core.judge: selector 'judge' needs a judge model" in i for i in issues)
    assert any("groups.core.replace_with: fallback 'replace_with' needs a replace_with map" in i
               for i in issues)


def test_pinned_groups_must_fit_max_loaded(tmp_path):
    issues = _issues(GROUPS.replace("max_loaded: 3", "max_loaded: 2"), tmp_path)
    assert any(":1: policy.max_loaded: pinned groups keep 3 models loaded (a, b, c) but "
               "max_loaded is 2" in i for i in issues)


def test_group_name_must_not_shadow_a_model(tmp_path):
    issues = _issues(GROUPS.replace("  core:\n", "  a:\n"), tmp_path)
    assert any("groups.a: group name 'a' is already a model name or alias" in i for i in issues)


def test_removed_llama_server_flags_are_refused_with_the_replacement(tmp_path):
    issues = _issues(GOOD.replace('args: ["--flash-attn", "auto"]', 'args: ["--mlock"]'),
                     tmp_path)
    assert any(":11: models.smol.args: Value error, llama-server no longer has --mlock; use "
               "--load-mode mlock" in i for i in issues)

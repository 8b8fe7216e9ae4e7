"""Config validation: precise errors with file, line and key; `corral check` exit codes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.supervisor.config import ConfigError, load_config, parse_config

from conftest import free_port

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
    assert [k.get_secret_value() for k in loaded.config.api_keys] == ["k-123", "fallback"]
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
    (tmp_path / "models").mkdir()  # check reports a model file that is not there
    (tmp_path / "models" / "smol.gguf").write_bytes(b"GGUF")
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
    assert any(":11: models.smol.args[0]: llama-server no longer has --mlock; use "
               "--load-mode mlock" in i for i in issues), issues


# -- per-model knobs ------------------------------------------------------------------------

KNOBS = """\
defaults:
  max_queue: 5
  queue_timeout: 30
  stop_grace: 2
  first_byte_timeout: 900
  health_failures: 5
  start_backoff: 0.5
models:
  plain: {model: p.gguf}
  tuned:
    model: t.gguf
    max_queue: 0
    queue_timeout: 7.5
    stop_grace: 0
    first_byte_timeout: 1200
    idle_timeout: 45
    health_interval: 1
    health_timeout: 0.5
    health_failures: 1
    start_backoff: 0
    start_backoff_max: 10
"""


def test_queue_and_stop_knobs_are_per_model_with_defaults_from_defaults():
    models = parse_config(KNOBS).models
    plain, tuned = models["plain"], models["tuned"]
    assert (plain.max_queue, plain.queue_timeout, plain.stop_grace) == (5, 30, 2)
    assert (tuned.max_queue, tuned.queue_timeout, tuned.stop_grace) == (0, 7.5, 0)


def test_reliability_knobs_default_and_override():
    models = parse_config(KNOBS).models
    plain, tuned = models["plain"], models["tuned"]
    knobs = ("first_byte_timeout", "idle_timeout", "health_interval", "health_timeout",
             "health_failures", "start_backoff", "start_backoff_max")
    # `defaults:` sets some; the rest keep the built-in defaults.
    assert [getattr(plain, k) for k in knobs] == [900, 120, 5, 3, 5, 0.5, 60]
    assert [getattr(tuned, k) for k in knobs] == [1200, 45, 1, 0.5, 1, 0, 10]
    assert isinstance(plain.health_failures, int)
    bare = parse_config("models: {m: {model: m.gguf}}\n").models["m"]
    assert [getattr(bare, k) for k in knobs] == [600, 120, 5, 3, 3, 1, 60]


def test_reliability_knobs_are_validated_with_line_and_key(tmp_path):
    text = (KNOBS.replace("first_byte_timeout: 900", "first_byte_timeout: 0")
            .replace("health_failures: 1", "health_failures: 0")
            .replace("start_backoff_max: 10", "start_backoff_max: -1")
            .replace("idle_timeout: 45", "idle_timeout: soon"))
    issues = _issues(text, tmp_path)
    where = tmp_path / "corral.yaml"
    assert any(i.startswith(f"{where}:5: defaults.first_byte_timeout: ") and "greater than 0"
               in i for i in issues)
    assert any(i.startswith(f"{where}:16: models.tuned.idle_timeout: ") for i in issues)
    assert any(i.startswith(f"{where}:19: models.tuned.health_failures: ") and
               "greater than or equal to 1" in i for i in issues)
    assert any(i.startswith(f"{where}:21: models.tuned.start_backoff_max: ") for i in issues)
    assert len(issues) == 4


def _argv(spec) -> list[str]:
    from corral.supervisor.backends.llama_server import LlamaServer

    return LlamaServer().argv(spec, 12345)


def test_embeddings_and_mmproj_reach_the_spec_and_the_argv(tmp_path):
    text = (f"binary: {sys.executable}\nmodels:\n"
            "  emb: {model: e.gguf, embeddings: true}\n"
            "  vis: {model: v.gguf, mmproj: proj/mmproj-v.gguf}\n")
    models = parse_config(text, source=tmp_path / "c.yaml").models
    emb, vis = models["emb"], models["vis"]
    assert (emb.embeddings, emb.mmproj) == (True, None)
    assert (vis.embeddings, vis.mmproj) == (False, tmp_path / "proj" / "mmproj-v.gguf")
    assert "--embeddings" in _argv(emb) and "--mmproj" not in _argv(emb)
    argv = _argv(vis)
    assert "--embeddings" not in argv
    assert argv[argv.index("--mmproj") + 1] == str(tmp_path / "proj" / "mmproj-v.gguf")


@pytest.mark.parametrize("arg", ["--host", "--port", "--port=123", "--api-key",
                                 "--api-key-file", "--api-key=secret"])
def test_args_may_not_set_what_corral_sets(tmp_path, arg):
    issues = _issues(GOOD.replace('args: ["--flash-attn", "auto"]', f'args: ["{arg}", "x"]'),
                     tmp_path)
    flag = arg.split("=")[0]
    assert len(issues) == 1
    assert f":11: models.smol.args: Value error, {flag} is not allowed in args: corral" \
        in issues[0]


def test_args_that_only_look_alike_pass():
    loaded = parse_config("models:\n  m:\n    model: m.gguf\n"
                          "    args: [--hostname-ish, --api-key-prefix, '--port-range']\n")
    assert loaded.models["m"].args == ("--hostname-ish", "--api-key-prefix", "--port-range")


# -- discovery ------------------------------------------------------------------------------

def _discovered(tmp_path: Path, *files: str, config: str = "") -> dict[str, tuple[str, str]]:
    """Discovered models as {name: (model file, projector file or '')}."""
    folder = tmp_path / "m"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"")  # discovery goes by names; nothing reads the files
    models = parse_config("models_dir: m\n" + config, source=tmp_path / "c.yaml").models
    return {name: (spec.model_path.name, spec.mmproj.name if spec.mmproj else "")
            for name, spec in models.items()}


def test_split_gguf_is_one_model_at_its_first_shard(tmp_path):
    found = _discovered(tmp_path, "big-Q4_K_M-00001-of-00003.gguf",
                        "big-Q4_K_M-00002-of-00003.gguf", "big-Q4_K_M-00003-of-00003.gguf",
                        "orphan-00002-of-00002.gguf", "small.gguf")
    # The later shards are never models; a split model without its first shard is skipped.
    assert found == {"big-Q4_K_M": ("big-Q4_K_M-00001-of-00003.gguf", ""),
                     "small": ("small.gguf", "")}


def test_configured_first_shard_is_not_discovered_again(tmp_path):
    found = _discovered(tmp_path, "big-00001-of-00002.gguf", "big-00002-of-00002.gguf",
                        config="models:\n  mine: {model: m/big-00001-of-00002.gguf}\n")
    assert found == {"mine": ("big-00001-of-00002.gguf", "")}


@pytest.mark.parametrize(("files", "expected"), [
    # mmproj first or last, with or without a precision tag; every quantisation of the model
    (["mmproj-foo.gguf", "foo.gguf"], {"foo": "mmproj-foo.gguf"}),
    (["foo-mmproj-f16.gguf", "foo-Q4_K_M.gguf", "foo-Q8_0.gguf", "bar.gguf"],
     {"foo-Q4_K_M": "foo-mmproj-f16.gguf", "foo-Q8_0": "foo-mmproj-f16.gguf", "bar": ""}),
    (["mmproj-Foo-BF16.gguf", "foo-IQ4_XS.gguf"], {"foo-IQ4_XS": "mmproj-Foo-BF16.gguf"}),
    # a nameless projector belongs to a folder of one model (in any quantisation)...
    (["mmproj-F16.gguf", "gem-Q4_K_M.gguf", "gem-Q8_0.gguf"],
     {"gem-Q4_K_M": "mmproj-F16.gguf", "gem-Q8_0": "mmproj-F16.gguf"}),
    # ...and to nobody in a folder of several
    (["mmproj-F16.gguf", "gem.gguf", "other.gguf"], {"gem": "", "other": ""}),
    # two projectors for one model: ambiguous, so none
    (["mmproj-foo-f16.gguf", "mmproj-foo-f32.gguf", "foo.gguf"], {"foo": ""}),
    # a projector whose model is not there is just ignored
    (["mmproj-ghost.gguf", "foo.gguf"], {"foo": ""}),
    # a split model gets its projector too
    (["vis-00001-of-00002.gguf", "vis-00002-of-00002.gguf", "vis-mmproj.gguf"],
     {"vis": "vis-mmproj.gguf"}),
])
def test_projectors_are_never_models_and_attach_when_unambiguous(tmp_path, files, expected):
    found = _discovered(tmp_path, *files)
    assert {name: proj for name, (_, proj) in found.items()} == expected


# -- admin exposure -------------------------------------------------------------------------

@pytest.mark.parametrize(("listen", "exposed"), [
    ("127.0.0.1:8080", False), ("127.3.4.5:8080", False), ("localhost:8080", False),
    ("[::1]:8080", False), ("0.0.0.0:8080", True), ("[::]:8080", True),
    ("192.168.1.10:8080", True), ("myhost.lan:8080", True)])
def test_admin_exposure_problem_on_open_admin(listen, exposed):
    from corral.supervisor.config import admin_exposure_problem, admin_is_exposed

    config = parse_config("").config
    problem = admin_exposure_problem(config, listen)
    assert (problem is not None) == exposed == admin_is_exposed(config, listen)
    if problem:
        assert listen in problem and "admin_open" in problem and "admin_api_keys" in problem


def test_admin_exposure_is_fine_with_keys_or_admin_open():
    from corral.supervisor.config import admin_exposure_problem, admin_is_exposed

    for text in ("api_keys: [k]\n", "admin_api_keys: [k]\n"):
        config = parse_config(text).config
        assert admin_exposure_problem(config, "0.0.0.0:8080") is None
        assert not admin_is_exposed(config, "0.0.0.0:8080")
    config = parse_config("admin_open: true\n").config
    assert admin_exposure_problem(config, "0.0.0.0:8080") is None
    assert admin_is_exposed(config, "0.0.0.0:8080")  # allowed, still exposed: serve warns


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corral.supervisor.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_refuses_open_admin_on_a_network_address(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("models: {}\n")
    started = time.monotonic()
    run = _cli("serve", "-c", str(cfg), "--listen", f"0.0.0.0:{free_port()}",
               "--state-dir", str(tmp_path / "state"))
    assert run.returncode == 2, run.stderr
    assert time.monotonic() - started < 15
    assert "error: listening on 0.0.0.0:" in run.stderr and "admin_open: true" in run.stderr


def test_serve_with_admin_open_warns_loudly_and_serves(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("admin_open: true\nmodels: {}\n")
    # Another xdist worker's process may take the port between the pick and the daemon's
    # bind (a second later): the daemon then exits on listen_failed, and runs again elsewhere.
    for _ in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(cfg),
             "--listen", f"0.0.0.0:{free_port()}", "--state-dir", str(tmp_path / "state"),
             "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:
                seen.append(line)
                if "corral.listening" in line or "corral.listen_failed" in line:
                    break
            if seen and "corral.listen_failed" in seen[-1] and "in use" in seen[-1]:
                continue
            assert any('"corral.admin_open"' in line and '"warning"' in line
                       for line in seen), seen
            assert seen and "corral.listening" in seen[-1] and proc.poll() is None, seen
            return
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    pytest.fail("the daemon lost its port five times in a row")


def test_check_reports_open_admin_for_the_configured_listen(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("models: {}\nlisten: 0.0.0.0:8080\n")
    run = _cli("check", str(cfg))
    assert run.returncode == 1
    assert f"error: {cfg}:2: listen: listening on 0.0.0.0:8080 (not loopback)" in run.stderr
    cfg.write_text("models: {}\nlisten: 0.0.0.0:8080\nadmin_api_keys: [k]\n")
    assert _cli("check", str(cfg)).returncode == 0


# -- chain templates ------------------------------------------------------------------------

def test_group_template_is_checked_at_load(tmp_path):
    text = (GROUPS.replace("type: fan_out", "type: chain").replace("    selector: judge\n", "")
            + '    template: "Improve: {nope}"\n')
    issues = _issues(text, tmp_path)
    assert any(i.startswith(f"{tmp_path / 'corral.yaml'}:15: groups.core.template: "
                            "unsupported field {nope}") for i in issues), issues
    good = text.replace("{nope}", "{previous} {{literal}}")
    path = tmp_path / "good.yaml"
    path.write_text(good)
    assert load_config(path).groups["core"].template == "Improve: {previous} {{literal}}"


# -- include: -------------------------------------------------------------------------------

def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_include_merges_maps_key_by_key_in_order(tmp_path):
    _write(tmp_path / "presets" / "base.yaml",
           "defaults: {ttl: 60, ctx: 1024}\npolicy: {max_loaded: 3}\n"
           "models:\n  a: {model: a.gguf, ttl: 10}\n  b: {model: b.gguf}\n"
           "api_keys: [base]\n")
    _write(tmp_path / "presets" / "more.yaml",
           "models:\n  c: {model: ../c.gguf}\ngroups:\n  g: {models: [a, c]}\n")
    main = _write(tmp_path / "corral.yaml",
                  "include: [presets/base.yaml, presets/more.yaml]\n"
                  "defaults: {ttl: 90}\nmodels:\n  a: {ctx: 2048}\napi_keys: [mine]\n")
    loaded = load_config(main)
    assert list(loaded.models) == ["a", "b", "c"]  # an included file adds models...
    a = loaded.models["a"]
    assert (a.ttl, a.ctx) == (10, 2048)  # ...and the includer overrides one key of one
    assert loaded.models["b"].ttl == 90 and loaded.models["b"].ctx == 1024  # defaults merged
    assert loaded.config.policy.max_loaded == 3
    # A list is replaced, not appended.
    assert [k.get_secret_value() for k in loaded.config.api_keys] == ["mine"]
    assert loaded.groups["g"].models == ("a", "c")
    # A relative path is relative to the file that wrote it.
    assert a.model_path == tmp_path / "presets" / "a.gguf"
    assert loaded.models["c"].model_path == tmp_path / "c.gguf"
    assert loaded.files == (main, tmp_path / "presets" / "base.yaml",
                            tmp_path / "presets" / "more.yaml")
    assert loaded.config.include == ["presets/base.yaml", "presets/more.yaml"]


def test_include_errors_point_at_the_included_file_and_line(tmp_path):
    _write(tmp_path / "extra.yaml", "models:\n  x:\n    model: x.gguf\n    tll: 5\n")
    main = _write(tmp_path / "corral.yaml", "include: extra.yaml\nmodels:\n  a: {model: a.gguf}\n")
    issues = [str(i) for i in _load_issues(main)]
    assert issues == [f"{tmp_path / 'extra.yaml'}:4: models.x.tll: Extra inputs are not permitted"]
    # A key the includer overrides is reported where the winning value was written.
    main.write_text("include: extra.yaml\nmodels:\n  x:\n    tll: 6\n")
    issues = [str(i) for i in _load_issues(main)]
    assert f"{main}:4: models.x.tll: Extra inputs are not permitted" in issues
    # Bad YAML in an included file: that file, that line.
    (tmp_path / "extra.yaml").write_text("models:\n  x: [unclosed\n")
    issues = [str(i) for i in _load_issues(main)]
    assert len(issues) == 1 and issues[0].startswith(f"{tmp_path / 'extra.yaml'}:3: ")
    assert "invalid YAML" in issues[0]


def test_include_missing_file_and_cycle_are_errors_at_the_include_line(tmp_path):
    main = _write(tmp_path / "corral.yaml", "models: {}\ninclude:\n  - nope.yaml\n  - a.yaml\n")
    _write(tmp_path / "a.yaml", "include: [corral.yaml]\n")
    with pytest.raises(ConfigError) as err:
        load_config(main)
    issues = [str(i) for i in err.value.issues]
    assert any(i.startswith(f"{main}:3: include[0]: cannot read {tmp_path / 'nope.yaml'}")
               for i in issues), issues
    assert f"{tmp_path / 'a.yaml'}:1: include[0]: include cycle: corral.yaml → a.yaml → " \
           "corral.yaml" in issues
    # The missing file is among the files read, so a watcher sees it appear.
    assert tmp_path / "nope.yaml" in err.value.files
    assert _load_issues(_write(tmp_path / "bad.yaml", "include: {a: 1}\n"))[0].message == \
        "include must be a file name or a list of file names"


def test_env_vars_in_included_files_and_include_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_TEST_PRESETS", str(tmp_path / "p"))
    monkeypatch.setenv("CORRAL_TEST_CTX_MODEL", "m.gguf")
    _write(tmp_path / "p" / "one.yaml", "models:\n  m: {model: '${CORRAL_TEST_CTX_MODEL}'}\n"
                                        "  n: {model: '${CORRAL_TEST_UNSET}'}\n")
    main = _write(tmp_path / "corral.yaml", "include: ['${CORRAL_TEST_PRESETS}/one.yaml']\n")
    issues = [str(i) for i in _load_issues(main)]
    assert issues == [f"{tmp_path / 'p' / 'one.yaml'}:3: models.n.model: environment variable "
                      "CORRAL_TEST_UNSET is not set"]
    monkeypatch.setenv("CORRAL_TEST_UNSET", "n.gguf")
    loaded = load_config(main)
    assert loaded.models["m"].model_path == tmp_path / "p" / "m.gguf"


def test_digest_follows_every_file(tmp_path):
    _write(tmp_path / "extra.yaml", "models: {x: {model: x.gguf}}\n")
    main = _write(tmp_path / "corral.yaml", "include: [extra.yaml]\n")
    first = load_config(main).digest
    assert load_config(main).digest == first
    (tmp_path / "extra.yaml").write_text("models: {x: {model: x.gguf, ttl: 5}}\n")
    assert load_config(main).digest != first


def _load_issues(path: Path) -> list:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return err.value.issues


def test_names_of_dots_alone_or_with_control_characters_are_refused(tmp_path):
    """A model called `..` could never be loaded, unloaded or followed from a browser or an
    SDK (they rewrite /admin/models/../load to /admin/load, escaped or not); a control
    character in a name would forge log lines. Refused where written, for models, aliases
    and groups alike."""
    text = GOOD + ("  '..':\n    model: x.gguf\n"
                   "  other:\n    model: y.gguf\n    aliases: ['.', \"tab\\there\"]\n")
    issues = _issues(text, tmp_path)
    assert any("models...: '..' is a path segment clients rewrite" in i for i in issues), issues
    assert any("models.other.aliases[0]: '.' is a path segment" in i for i in issues), issues
    assert any("models.other.aliases[1]: 'tab\\there' holds a control character" in i
               for i in issues), issues
    issues = _issues(GROUPS.replace("  core:\n", "  '...':\n"), tmp_path)
    assert any("'...' is a path segment clients rewrite" in i for i in issues), issues
    # Dots inside a name are fine (a file's name, a version).
    path = tmp_path / "dotted.yaml"
    path.write_text(GOOD.replace("  smol:\n", "  .smol.v1.5.:\n"))
    assert ".smol.v1.5." in load_config(path).models


def test_keys_no_header_can_carry_and_empty_keys_are_refused_unquoted(tmp_path, monkeypatch):
    """An empty key would be matched by a bare `Authorization: Bearer` (anyone in); one with
    a space, a control or a non-ASCII character can be sent by no HTTP client (a browser's
    fetch throws, the SDKs refuse). Refused where written, for every key and token, without
    the key in the message."""
    monkeypatch.delenv("CORRAL_TEST_UNSET_KEY", raising=False)
    text = ("api_keys: ['${CORRAL_TEST_UNSET_KEY:-}', 'ok-key']\n"
            "admin_api_keys: ['s3cr\u00e9t-admin']\n"
            "worker: {token: 'tok en-x'}\n"
            "peers: {p: {url: 'http://10.0.0.2:8080', token: ''}}\n" + GOOD
            + "  far:\n    backend: remote\n    url: http://10.0.0.3:8000\n"
              "    api_key: \"line\\nbreak-key\"\n")
    issues = _issues(text, tmp_path)
    said = "\n".join(issues)
    assert any(": api_keys[0]: " in i and "may not be empty" in i for i in issues), said
    assert not any(": api_keys[1]: " in i for i in issues), said
    for where in ("admin_api_keys[0]", "worker.token", "models.far.api_key"):
        assert any(f": {where}: " in i and "cannot send it" in i for i in issues), (where, said)
    assert any(": peers.p.token: " in i and "may not be empty" in i for i in issues), said
    for secret in ("s3cr", "tok en", "break-key"):
        assert secret not in said
    # A key of visible ASCII passes, symbols included; a remote's empty key is none (an
    # endpoint that needs none, `${OPENAI_API_KEY:-}`): nothing to match, nothing sent.
    path = tmp_path / "fine.yaml"
    path.write_text("api_keys: ['sk-A1_b.c~d+e/f=', '!#$%&*']\n" + GOOD
                    + "  far:\n    backend: remote\n    url: http://10.0.0.3:8000\n"
                      "    api_key: ''\n")
    loaded = load_config(path)
    assert len(loaded.config.api_keys) == 2
    assert loaded.config.models["far"].api_key is None

"""What a newcomer following the docs hit (issue 28): `corral check` names every file a config
names that is not there and every error in one run; every relative path in a config is
relative to the file that wrote it; `serve --models-dir` on a missing folder says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from corral.supervisor.backends.binaries import find_executable
from corral.supervisor.config import parse_config

from conftest import CorralFactory, tiny_config

CLI = [sys.executable, "-m", "corral.supervisor.cli"]


def cli(*args: str, cwd: Path | None = None, timeout: float = 60,
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, check=False)


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error: ")]


# -- corral check: the files a config names ---------------------------------------------------

def test_check_names_every_missing_file_with_its_line(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "sub").mkdir(parents=True)
    (conf / "here.gguf").write_bytes(b"GGUF")
    # An included file's paths are its own folder's.
    (conf / "sub" / "more.yaml").write_text(
        "models:\n"
        "  seer:\n"
        "    model: ../here.gguf\n"
        "    mmproj: proj.gguf\n")
    path = conf / "corral.yaml"
    path.write_text(
        "include: sub/more.yaml\n"              # 1
        "models_dir: store\n"                   # 2
        "binary: bin/llama-server\n"            # 3
        "models:\n"                             # 4
        "  a:\n"                                # 5
        "    model: missing.gguf\n"             # 6
        "  b:\n"                                # 7
        "    model: here.gguf\n"                # 8
        "    binary: /nowhere/llama-server\n"   # 9
        "  v:\n"                                # 10
        "    backend: vllm\n"                   # 11
        "    model: ckpt\n"                     # 12
        "    command: [venv/bin/python, -m, vllm.entrypoints.openai.api_server]\n"  # 13
        "  hub:\n"                              # 14
        "    backend: vllm\n"                   # 15
        "    model: org/name\n"                 # 16
        "    command: [vllm, serve]\n"          # 17
        "  cmd:\n"                              # 18
        "    backend: command\n"                # 19
        "    command: [./serve.sh, --port, '${PORT}']\n"  # 20
        "  bare:\n"                             # 21
        "    backend: command\n"                # 22
        "    command: [no-such-server-on-path, --port, '${PORT}']\n")  # 23
    done = cli("check", str(path))
    assert done.returncode == 1, done.stdout
    errors = error_lines(done)
    expected = {
        f"{path}:2: models_dir": f"folder {conf / 'store'} does not exist",
        f"{path}:3: binary": f"{conf / 'bin' / 'llama-server'} does not exist",
        f"{path}:6: models.a.model": f"{conf / 'missing.gguf'} does not exist",
        f"{path}:9: models.b.binary": "/nowhere/llama-server does not exist",
        f"{path}:12: models.v.model": f"{conf / 'ckpt'} does not exist",
        f"{path}:13: models.v.command[0]": f"{conf / 'venv' / 'bin' / 'python'} does not exist",
        f"{path}:20: models.cmd.command[0]": f"{conf / 'serve.sh'} does not exist",
        f"{conf / 'sub' / 'more.yaml'}:4: models.seer.mmproj":
            f"{conf / 'sub' / 'proj.gguf'} does not exist",
    }
    for where, what in expected.items():
        assert any(line.startswith(f"error: {where}: ") and what in line for line in errors), (
            where, errors)
    # A Hugging Face id, and names looked up on PATH when the child starts, are no files here.
    assert len(errors) == len(expected), errors

    # --no-files: the config alone (one written for another machine).
    alone = cli("check", "--no-files", str(path))
    assert alone.returncode == 0, alone.stderr
    assert f"{path}: ok (" in alone.stdout


def test_check_reports_schema_and_cross_section_errors_in_one_run(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    path = tmp_path / "corral.yaml"
    path.write_text(
        "policy: {max_loaded: 0}\n"                     # 1: schema (ge=1)
        "models:\n"                                     # 2
        "  a:\n"                                        # 3
        "    model: m.gguf\n"                           # 4
        "    paralel: 2\n"                              # 5: schema (unknown key)
        "  b:\n"                                        # 6
        "    model: m.gguf\n"                           # 7
        "    args: [--mlock]\n"                         # 8: cross-section (removed flag)
        "    kv_cache_dtype: fp8\n"                     # 9: cross-section (vLLM's key)
        "    aliases: [a]\n"                            # 10: cross-section (a model's name)
        "groups:\n"                                     # 11
        "  g: {models: [a, nope]}\n"                    # 12: cross-section (unknown member)
        "  h: {models: [a], type: vote}\n")             # 13: schema (not a group type)
    done = cli("check", str(path))
    assert done.returncode == 1
    errors = "\n".join(error_lines(done))
    for where in (f"{path}:1: policy.max_loaded", f"{path}:5: models.a.paralel",
                  f"{path}:8: models.b.args[0]", f"{path}:9: models.b.kv_cache_dtype",
                  f"{path}:10: models.b.aliases[0]", f"{path}:12: groups.g",
                  f"{path}:13: groups.h.type"):
        assert where in errors, (where, errors)
    assert "--mlock" in errors and "unknown" in errors, errors


def test_check_reports_the_strategy_plugin_beside_schema_errors(tmp_path: Path) -> None:
    path = tmp_path / "corral.yaml"
    path.write_text("policy: {strategy: 'plugin:gone.py:Strategy'}\n"
                    "defaults: {ttl: -5}\n")
    errors = "\n".join(error_lines(cli("check", "--no-files", str(path))))
    assert f"{path}:2: defaults.ttl" in errors, errors
    assert f"{path}:1: policy.strategy" in errors and "gone.py" in errors, errors


def test_an_unset_environment_variable_is_one_error_among_the_others(tmp_path: Path) -> None:
    path = tmp_path / "corral.yaml"
    path.write_text("listen: ${CORRAL_TEST_UNSET_LISTEN}\n"
                    "models:\n"
                    "  a: {model: m.gguf, paralel: 2, args: [--mlock]}\n")
    done = cli("check", "--no-files", str(path))
    assert error_lines(done) == [
        f"error: {path}:1: listen: environment variable CORRAL_TEST_UNSET_LISTEN is not set",
        f"error: {path}:3: models.a.paralel: Extra inputs are not permitted",
        f"error: {path}:3: models.a.args[0]: llama-server no longer has --mlock; use "
        f"--load-mode mlock (or mmap+mlock)",
    ], done.stderr  # and nothing about the empty listen the unset variable left


# -- one rule for relative paths ---------------------------------------------------------------

def test_every_relative_path_is_relative_to_the_file_that_wrote_it(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "sub").mkdir(parents=True)
    (conf / "sub" / "more.yaml").write_text(
        "models:\n"
        "  inc: {model: m.gguf, binary: bin/llama-server}\n")
    loaded = parse_config(
        "include: sub/more.yaml\n"
        "binary: bin/llama-server\n"
        "state_dir: state\n"
        "prompt_cache: {dir: cache}\n"
        "models:\n"
        "  a: {model: m.gguf}\n"
        "  b: {model: m.gguf, binary: ~/llama-server}\n"
        "  onpath: {model: m.gguf, binary: llama-server}\n"
        "  v: {backend: vllm, model: ckpt, command: [venv/bin/python, -m, vllm.x]}\n"
        "  vpath: {backend: vllm, model: ckpt, command: [vllm, serve]}\n"
        "  cmd: {backend: command, command: [./serve.sh, --port, '${PORT}', data/x]}\n",
        source=conf / "corral.yaml")
    models = loaded.models
    assert models["a"].binary == str(conf / "bin" / "llama-server")
    assert loaded.binary == str(conf / "bin" / "llama-server")
    assert models["inc"].binary == str(conf / "sub" / "bin" / "llama-server")
    assert models["b"].binary == str(Path.home() / "llama-server")
    assert models["onpath"].binary == "llama-server"  # a name: looked up on PATH
    assert models["v"].command == (str(conf / "venv" / "bin" / "python"), "-m", "vllm.x")
    assert models["vpath"].command == ("vllm", "serve")
    # The executable only: the other arguments are the server's, passed as written.
    assert models["cmd"].command == (str(conf / "serve.sh"), "--port", "${PORT}", "data/x")
    assert loaded.state_dir == conf / "state"
    assert loaded.prompt_cache_dir == conf / "cache"


def test_a_relative_binary_is_found_from_the_config_folder_not_the_working_one(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    """The daemon runs in the factory's folder; the config and its `bin/` lie a folder down."""
    conf = start_corral.folder / "conf"
    (conf / "bin").mkdir(parents=True)
    (conf / "bin" / "llama-server").symlink_to(find_executable(None, ("llama-server",)))
    config = tiny_config(tiny_models, ["tiny-a"], binary="bin/llama-server")
    config["models"]["gone"] = {"model": "gone.gguf"}
    path = conf / "corral.yaml"
    path.write_text(yaml.safe_dump(config))
    corral = start_corral.serve(path)
    resp = corral.chat("tiny-a", max_tokens=2)
    assert resp.status_code == 200, resp.text
    argv = corral.spawned("tiny-a")[-1]["argv"]
    assert argv[0] == str(conf / "bin" / "llama-server")
    # What `corral check` calls an error, serve warns of (and starts: it may appear later).
    (warned,) = corral.log_events("config.missing_file")
    assert warned["key"] == "models.gone.model" and warned["level"] == "warning", warned
    assert str(conf / "gone.gguf") in warned["problem"]


# -- serve --models-dir ------------------------------------------------------------------------

@pytest.mark.parametrize("with_config", [False, True])
def test_serve_refuses_a_models_dir_that_is_not_there(tmp_path: Path, with_config: bool) -> None:
    config = tmp_path / "corral.yaml"
    config.write_text("models: {}\n")
    args = ["serve", "--models-dir", "nowhere", "--state-dir", str(tmp_path / "state")]
    done = cli(*args, *(["-c", str(config)] if with_config else []), cwd=tmp_path, timeout=30)
    assert done.returncode == 2, done.stderr
    assert f"error: --models-dir {tmp_path / 'nowhere'}: no such folder" in done.stderr
    (tmp_path / "afile").write_text("")
    done = cli("serve", "--models-dir", "afile", cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "is not a folder" in done.stderr, done.stderr


def test_help_says_which_paths_are_relative_to_what() -> None:
    done = cli("serve", "--help")
    assert "relative to the working directory" in " ".join(done.stdout.split())

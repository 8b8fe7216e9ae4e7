"""`backend: command`, for real: Hugging Face `transformers serve` (its own venv, build/hf-venv,
made by `make hf`) serving the tiny HF checkpoint, and llama-server started through the
generic path, both with a served_name corral renames both ways."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from tinyhf import SPECIALS, write_tiny_hf_llama

from conftest import Corral, CorralFactory, group_of, llama_server_binary, port_is_free, wait_until

ROOT = Path(__file__).resolve().parent.parent
HF_SERVE = Path(os.environ.get("CORRAL_HF_SERVE", ROOT / "build/hf-venv/bin/transformers"))
HI = [{"role": "user", "content": "hi"}]
# tests/tinyhf.py's <unk>, <s> and </s> (its tokenizer's first ids).
NO_SPECIALS = {str(i): -100.0 for i in range(len(SPECIALS))}  # transformers takes floats only
COLD_START = 300  # seconds: 6 s alone, slower beside a suite on two cores

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert HF_SERVE.is_file(), f"{HF_SERVE} missing: run `make hf` (make test does it)"
    return write_tiny_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-hf")


def command_config(checkpoint: Path, tiny_models: dict[str, Path]) -> dict[str, Any]:
    return {
        "defaults": {"ttl": 600, "stop_grace": 10},
        "models": {
            "hf": {"backend": "command", "served_name": str(checkpoint), "memory_mb": 700,
                   "stop_signal": "SIGINT", "start_timeout": COLD_START,
                   "command": [str(HF_SERVE), "serve", "--host", "127.0.0.1",
                               "--port", "${PORT}", "--device", "cpu", str(checkpoint)]},
            "llama-cmd": {"backend": "command", "served_name": "tiny-served",
                          "command": [llama_server_binary(), "--model",
                                      str(tiny_models["tiny-a"]), "--host", "127.0.0.1",
                                      "--port", "${PORT}", "--alias", "tiny-served",
                                      "--ctx-size", "2048", "--threads", "1"]},
        },
    }


@pytest.fixture(scope="module")
def served(start_corral_module: CorralFactory, checkpoint: Path,
           tiny_models: dict[str, Path]) -> Corral:
    return start_corral_module(command_config(checkpoint, tiny_models))




def test_transformers_serve_starts_answers_and_streams_under_corrals_name(
        served: Corral, checkpoint: Path) -> None:
    client = served.client(timeout=COLD_START)
    reply = client.chat.completions.create(model="hf", messages=HI, max_tokens=4)
    # The server knows the checkpoint's path; the client hears the model's corral name.
    assert reply.model == "hf", reply
    assert reply.choices[0].message.content is not None
    state = served.model("hf")
    assert (state["state"], state["backend"]) == ("ready", "command")
    argv = psutil.Process(state["pid"]).cmdline()
    assert argv[argv.index("--port") + 1] == str(state["port"])  # ${PORT} filled in
    # The random checkpoint may pick a special token (its end of text, or one decoded to
    # nothing) first on another CPU's numerics: biased out, so the stream has text to carry.
    chunks = list(client.chat.completions.create(model="hf", messages=HI, max_tokens=3,
                                                 stream=True, logit_bias=NO_SPECIALS))
    assert chunks and {c.model for c in chunks} == {"hf"}, chunks
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    # corral cannot estimate it: memory_mb counts until the child is measured.
    by = {m["name"]: m for m in served.http.get("/admin/memory").json()["models"]}
    assert by["hf"]["estimate_mib"] == {"cpu": 700}, by["hf"]


def test_llama_server_through_the_generic_path(served: Corral) -> None:
    reply = served.client(timeout=120).chat.completions.create(
        model="llama-cmd", messages=HI, max_tokens=3)
    assert reply.model == "llama-cmd"
    argv = psutil.Process(served.model("llama-cmd")["pid"]).cmdline()
    assert argv[0] == llama_server_binary() and "${PORT}" not in argv


def test_kill_9_then_the_next_request_starts_it_again(served: Corral) -> None:
    client = served.client(timeout=COLD_START)
    assert client.chat.completions.create(model="hf", messages=HI, max_tokens=1)
    pid = served.model("hf")["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: served.model("hf")["state"] == "failed", timeout=30)
    wait_until(lambda: not group_of(pid), timeout=30)
    reply = client.chat.completions.create(model="hf", messages=HI, max_tokens=2)
    assert reply.model == "hf"
    assert served.model("hf")["pid"] not in (None, pid)


def test_unload_stops_its_whole_group_and_ttl_stops_it(served: Corral) -> None:
    client = served.client(timeout=COLD_START)
    assert client.chat.completions.create(model="hf", messages=HI, max_tokens=1)
    state = served.model("hf")
    pid, port = state["pid"], state["port"]
    assert served.http.post("/admin/models/hf/unload").status_code == 200
    wait_until(lambda: served.model("hf")["state"] == "stopped", timeout=60)
    wait_until(lambda: not group_of(pid), timeout=20)
    assert port_is_free(port)
    # TTL: the next start stops on its own once idle.
    config = yaml.safe_load(served.config_path.read_text())
    config["models"]["hf"]["ttl"] = 2
    served.config_path.write_text(yaml.safe_dump(config))
    assert served.http.post("/admin/reload").status_code == 200
    assert client.chat.completions.create(model="hf", messages=HI, max_tokens=1)
    pid = served.model("hf")["pid"]
    wait_until(lambda: served.model("hf")["state"] == "stopped", timeout=60)
    wait_until(lambda: not group_of(pid), timeout=20)
    assert [e for e in served.log_events("daemon.ttl_expired") if e.get("model") == "hf"]

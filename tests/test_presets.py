"""The shipped presets: each passes `corral check`, matches the committed JSON Schema (which
must equal `corral schema`'s output), starts with the yaml-language-server line, and serves a
request as is, straight from its file, on the demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from corral.supervisor.backends.binaries import find_executable

from conftest import Corral, CorralFactory, wait_until

REPO = Path(__file__).resolve().parent.parent
PRESETS = REPO / "presets"
SCHEMA = PRESETS / "corral.schema.json"
ALL = sorted(PRESETS.rglob("*.yaml"))
IDS = [str(p.relative_to(PRESETS)) for p in ALL]
CLI = [sys.executable, "-m", "corral.supervisor.cli"]
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_the_presets_are_there() -> None:
    names = {str(p.relative_to(PRESETS)) for p in ALL}
    assert {"generic.yaml", "groups.yaml", "pinned-group.yaml", "multi-group.yaml",
            "fixed-appliance.yaml", "memory.yaml", "vllm.yaml", "distributed-rpc.yaml",
            "openwebui.yaml", "contrib/biggest-first.yaml", "transformers.yaml",
            "remote.yaml", "council.yaml"} <= names


# What the vLLM and transformers presets start, named by ${VLLM_PYTHON:-../build/vllm-venv/...}
# and ${TRANSFORMERS:-../build/hf-venv/...}: `corral check` reports a missing one.
EXECUTABLES = ("VLLM_PYTHON", "TRANSFORMERS")
# Where README's set-up (`make test`: demo-model, embed-model, vllm, hf) puts what they name.
SETUP_STEPS = ("`make demo-model`", "`make embed-model`", "`make vllm`", "`make hf`")


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_corral_check_passes(path: Path, tmp_path: Path, minilm_model: Path) -> None:
    # Stand-ins that exist (that the real ones start is test_vllm's and test_command's
    # business; asking the real vLLM for its KV dtypes takes half a minute).
    env = {**os.environ}
    for name in EXECUTABLES:
        stand_in = tmp_path / name.lower()
        stand_in.write_text("#!/bin/sh\nexit 1\n")
        stand_in.chmod(0o755)
        env[name] = str(stand_in)
    done = subprocess.run([*CLI, "check", str(path)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert ": ok (" in done.stdout
    # As printed, with the venvs `make vllm` and `make hf` put in build/: after README's
    # set-up it passes; before, each thing missing names the set-up step that makes it.
    bare = subprocess.run([*CLI, "check", str(path)], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if k not in EXECUTABLES})
    for line in bare.stderr.splitlines():
        assert "does not exist" in line and any(s in line for s in SETUP_STEPS), bare.stderr


def test_on_a_fresh_checkout_check_names_the_setup_step_each_preset_lacks(
        tmp_path: Path) -> None:
    """The presets copied to a checkout with no models/ and no build/ (a fresh clone): every
    error `corral check` prints names the Makefile target that makes what is missing."""
    fresh = tmp_path / "presets"
    for path in [*ALL, *PRESETS.rglob("*.py")]:
        target = fresh / path.relative_to(PRESETS)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    copies = sorted(fresh.rglob("*.yaml"))
    done = subprocess.run([*CLI, "check", *map(str, copies)], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k not in EXECUTABLES})
    errors = done.stderr.splitlines()
    assert done.returncode == 1 and errors, done
    for line in errors:
        assert line.startswith("error: ") and "does not exist" in line, line
        assert any(f"({s} in corral's checkout sets it up)" in line for s in SETUP_STEPS), line
    named = " ".join(errors)
    for step, preset in (("`make vllm`", "vllm.yaml"), ("`make hf`", "transformers.yaml"),
                         ("`make embed-model`", "council.yaml"),
                         ("`make demo-model`", "generic.yaml")):
        assert any(step in e and preset in e for e in errors), (step, named)


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_the_first_line_points_editors_at_the_schema(path: Path) -> None:
    relative = Path("..") if path.parent != PRESETS else Path(".")
    first = path.read_text().splitlines()[0]
    assert first == f"# yaml-language-server: $schema={relative.as_posix()}/corral.schema.json"
    # ...and that path reaches the schema from the preset's folder.
    assert (path.parent / relative / "corral.schema.json").resolve() == SCHEMA


def test_the_committed_schema_is_what_corral_schema_prints() -> None:
    done = subprocess.run([*CLI, "schema"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == SCHEMA.read_text(), (
        "presets/corral.schema.json is stale: regenerate it with "
        "`.venv/bin/corral schema > presets/corral.schema.json`")
    schema = json.loads(done.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"]
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_every_preset_validates_against_the_schema(path: Path,
                                                   validator: jsonschema.Draft202012Validator
                                                   ) -> None:
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
    assert not errors, errors


def test_the_schema_catches_what_check_catches(
        validator: jsonschema.Draft202012Validator) -> None:
    """The schema is strict like the models it comes from, so an editor flags typos."""
    good = {"policy": {"strategy": "multi-group", "shares": {"g": 1}},
            "models": {"m": {"model": "m.gguf", "ttl": 0, "args": ["--temp", "0.1"]}}}
    assert validator.is_valid(good)
    for bad in ({"models": {"m": {"model": "m.gguf", "tll": 5}}},   # unknown key
                {"models": {"m": {"ttl": 5}}},                      # model is required
                {"models": {"m": {"backend": "vllm"}}},             # ...by vllm too
                {"defaults": {"parallel": 0}},                      # below its minimum
                {"groups": {"g": {"models": ["m"], "type": "vote"}}}):  # not a group type
        assert not validator.is_valid(bad), bad


# -- serving each preset as is --------------------------------------------------------------------

def serve_preset(factory: CorralFactory, path: Path) -> Corral:
    """`corral serve -c <preset>` from the preset's own file (its relative model paths and
    plugin path resolve against presets/), on a free port, with its log and pid file in the
    factory's folder; the factory's close() stops it and fails on any orphaned child."""
    return factory.serve(path)


def ask(corral: Corral, model: str) -> str:
    """One chat completion through the OpenAI SDK: 200 with some content (`ignore_eos`: under
    a preset's quantized KV cache or sampling a model may end at its first token on some
    CPUs)."""
    answer = corral.client(timeout=120).chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, extra_body={"ignore_eos": True})
    content = answer.choices[0].message.content
    assert content and content.strip(), answer
    return content


def ask_plain(corral: Corral, model: str) -> str:
    """The demo question as Open WebUI sends it (no system message, no sampling settings): the
    preset's request profile makes the demo model answer it right."""
    answer = corral.client(timeout=120).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}])
    content = answer.choices[0].message.content or ""
    assert "Paris" in content, (model, content)
    return content


def ask_group(corral: Corral, group: str) -> dict[str, Any]:
    """One POST /v1/batch/execute: 200, complete, and every member answered something."""
    resp = corral.http.post("/v1/batch/execute", timeout=180, json={
        "group": group, "messages": QUESTION, "max_tokens": 8, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    assert result["complete"], result
    for member in result["responses"]:
        assert member["status"] == "ok" and member["content"].strip(), result
    if result["type"] in ("fan_out", "consensus", "chain"):
        assert result["final"].strip(), result
    return result


def ready(corral: Corral, names: list[str]) -> bool:
    models = corral.models()
    return all(models[n]["state"] == "ready" for n in names)


def loaded(corral: Corral) -> set[str]:
    return {n for n, m in corral.models().items() if m["state"] in ("starting", "ready")}


def test_generic_serves_on_demand(start_corral: CorralFactory, smol_model: Path) -> None:
    corral = serve_preset(start_corral, PRESETS / "generic.yaml")
    assert loaded(corral) == set()
    ask(corral, "default")  # the alias of `smol`
    assert corral.model("smol")["state"] == "ready"
    ask_plain(corral, "smol")
    # The demo file is `smol`'s: discovery does not serve it under its own name as well.
    assert "SmolLM2-135M-Instruct.Q4_1" not in corral.models()


def test_openwebui_streams_the_load_then_a_right_answer(start_corral: CorralFactory,
                                                       smol_model: Path, tmp_path: Path) -> None:
    # The load must outlast the progress's 0.5 s grace: SmolLM2 from a warm page cache can
    # load within it (CI saw it), and then there is rightly nothing to show. The llama-server
    # found first on PATH waits 1.5 s, then is the real one.
    real = find_executable(None, ("llama-server",))
    slow = tmp_path / "bin" / "llama-server"
    slow.parent.mkdir()
    slow.write_text(f'#!/bin/sh\nsleep 1.5\nexec "{real}" "$@"\n')
    slow.chmod(0o755)
    corral = start_corral.serve(PRESETS / "openwebui.yaml",
                                env={"PATH": f"{slow.parent}:{os.environ['PATH']}"})
    assert corral.log_events("child.spawned") == []  # on demand: the request starts it
    # As Open WebUI asks: streamed, no system message, no sampling settings.
    stream = corral.client(timeout=120).chat.completions.create(
        model="default", stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    thinking, answer = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            thinking.append((delta.model_extra or {}).get("reasoning_content") or "")
            answer.append(delta.content or "")
    assert "Loading smol" in "".join(thinking) and "ready after" in "".join(thinking)
    assert "Paris" in "".join(answer), answer
    status = {m["id"]: m["status"] for m in corral.http.get("/models").json()["data"]}
    assert status["smol"] == {"value": "loaded"}


def test_groups_serves_its_groups(start_corral: CorralFactory, smol_model: Path) -> None:
    corral = serve_preset(start_corral, PRESETS / "groups.yaml")
    # council is pinned: both members come up without a request.
    assert wait_until(lambda: ready(corral, ["smol-careful", "smol-creative"]), timeout=60)
    ask_plain(corral, "smol-careful")
    # Exposed as a model: the synthesis of both answers, one of them sampled (temp 0.9), so
    # what it says is the sampler's; that it answers is corral's.
    ask(corral, "council")
    result = ask_group(corral, "both")
    assert [r["model"] for r in result["responses"]] == ["smol-careful", "smol-creative"]


def test_council_votes_by_extraction_and_by_meaning(start_corral: CorralFactory,
                                                    smol_model: Path,
                                                    minilm_model: Path) -> None:
    corral = serve_preset(start_corral, PRESETS / "council.yaml")
    for group, compare in (("sums", "extract"), ("facts", "extract"),
                           ("paraphrases", "extract+similar"), ("council", "similar")):
        resp = corral.http.post("/v1/batch/execute", timeout=180, json={
            "group": group, "messages": [{"role": "user", "content": "What is 7 + 5?"}],
            "max_tokens": 24})
        assert resp.status_code == 200, resp.text
        result = resp.json()
        vote = result["vote"]
        assert vote["compare"] == compare and vote["of"] == 3, vote
        assert result["complete"] == (vote.get("quorum_met", True)), result
        assert result["final"].strip(), result
    facts = [json.loads(m["content"]) for m in result_of(corral, "facts")["responses"]]
    assert all(isinstance(f["answer"], str) for f in facts)  # response_format reached them


def result_of(corral: Corral, group: str) -> dict[str, Any]:
    resp = corral.http.post("/v1/batch/execute", timeout=180, json={
        "group": group, "messages": QUESTION, "max_tokens": 24})
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


def test_pinned_group_keeps_the_council_up(start_corral: CorralFactory,
                                           smol_model: Path) -> None:
    council = ["judge-careful", "judge-balanced", "judge-creative"]
    corral = serve_preset(start_corral, PRESETS / "pinned-group.yaml")
    assert wait_until(lambda: ready(corral, council), timeout=60)
    assert corral.model("assistant")["state"] == "stopped"  # on demand
    ask_plain(corral, "default")  # the alias of `assistant`
    assert loaded(corral) == {*council, "assistant"}
    ask(corral, "council")  # exposed as a model: the synthesized answer
    result = ask_group(corral, "council")
    assert result["synthesis"]["model"] == "judge-careful"


def test_multi_group_keeps_both_cores_up(start_corral: CorralFactory,
                                         smol_model: Path) -> None:
    core_a = ["a-careful", "a-balanced", "a-creative"]
    core_b = ["b-careful", "b-balanced", "b-creative"]
    corral = serve_preset(start_corral, PRESETS / "multi-group.yaml")
    # Each share is as big as its core: all six load at boot.
    assert wait_until(lambda: ready(corral, core_a + core_b), timeout=90)
    pids = {n: corral.model(n)["pid"] for n in core_a + core_b}
    ask_plain(corral, "b-careful")
    result = ask_group(corral, "core_a")
    assert [r["model"] for r in result["responses"]] == core_a
    ask(corral, "core_b")  # exposed as a model: the majority answer
    assert {n: corral.model(n)["pid"] for n in pids} == pids  # nothing swapped


@pytest.mark.expect_log("proxy.request_failed")
def test_fixed_appliance_serves_its_set_only(start_corral: CorralFactory,
                                             smol_model: Path) -> None:
    corral = serve_preset(start_corral, PRESETS / "fixed-appliance.yaml")
    assert wait_until(lambda: ready(corral, ["chat", "summarize"]), timeout=60)
    ask_plain(corral, "chat")
    ask(corral, "summarize")
    resp = corral.chat("experimental", max_tokens=8)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "model_not_served"
    assert loaded(corral) == {"chat", "summarize"}


def test_biggest_first_plugin_runs(start_corral: CorralFactory, smol_model: Path) -> None:
    """What corral guarantees, not the tiny model's wording (a quantized cache's numerics
    differ by CPU): the plugin's KV types reached each child, each answer arrived whole, and
    the third start evicted one of the first two."""
    corral = serve_preset(start_corral, PRESETS / "contrib" / "biggest-first.yaml")
    for name in ("small-a", "small-b", "small-c"):
        answer = corral.client(timeout=120).chat.completions.create(
            model=name, messages=QUESTION, max_tokens=8, extra_body={"ignore_eos": True})
        choice = answer.choices[0]
        assert choice.finish_reason == "length" and choice.message.content, answer
        assert answer.model == name and answer.usage and answer.usage.completion_tokens == 8
    # max_loaded 2: the third start stopped one of the first two.
    assert len(loaded(corral)) == 2 and "small-c" in loaded(corral)
    assert corral.log_events("instance.stop")
    # The demo model is over big_model_bytes: the plugin started it with K f16 and V q8_0.
    for name in ("small-a", "small-b", "small-c"):
        argv = corral.spawned(name)[-1]["argv"]
        kv = (argv[argv.index("--cache-type-k") + 1], argv[argv.index("--cache-type-v") + 1])
        assert kv == ("f16", "q8_0"), argv
    small_c = corral.model("small-c")
    assert (small_c["cache_type_k"], small_c["cache_type_v"]) == ("f16", "q8_0")


def test_memory_preset_runs_with_budgets_and_kv_modes(start_corral: CorralFactory,
                                                      smol_model: Path) -> None:
    corral = serve_preset(start_corral, PRESETS / "memory.yaml")
    ask_plain(corral, "default")  # the alias of `chat`: adaptive, starts at the ladder's top
    ask(corral, "writer")  # auto: f16 fits the budget
    ask(corral, "reviewer")  # fixed asymmetric types
    ask_group(corral, "core")
    memory = corral.http.get("/admin/memory").json()
    assert memory["budgets_mb"] == {"core": 6000} and memory["watermarks"]["low"] == 85
    by = {m["name"]: m for m in memory["models"]}
    assert (by["chat"]["cache_type_k"], by["chat"]["kv_cache"]["adaptive"]) == ("f16", True)
    assert (by["writer"]["cache_type_k"], by["writer"]["kv_cache"]["mode"]) == ("f16", "auto")
    assert (by["reviewer"]["cache_type_k"], by["reviewer"]["cache_type_v"]) == ("q8_0", "q4_0")
    assert by["reviewer"]["kv_cache"] is None
    for name in ("chat", "writer", "reviewer", "core-a", "core-b"):
        assert by[name]["estimate_mib"]["cpu"] > 0, by[name]
    # Its relay workers serve a ready model's requests (a start, a group: the daemon's).
    def by_a_worker() -> bool:
        ask_plain(corral, "default")
        last = corral.http.get("/admin/requests", params={"limit": 1}).json()["requests"][-1]
        return last["worker"] is not None
    wait_until(by_a_worker, timeout=30)


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_vllm_preset_serves_its_gguf_model_and_says_how_to_get_vllm(
        start_corral: CorralFactory, smol_model: Path) -> None:
    """With VLLM_PYTHON naming a vLLM that is not there (the preset's default, `make vllm`'s
    venv, would start a real 7B), the GGUF model answers, and a vLLM model gets an
    OpenAI-shaped 502 saying how to install vLLM; the group answers with the member it has
    (tests/test_vllm.py runs real vLLM children)."""
    assert not Path("/opt/vllm/bin/python").exists()
    corral = start_corral.serve(PRESETS / "vllm.yaml",
                                env={"VLLM_PYTHON": "/opt/vllm/bin/python"})
    ask_plain(corral, "helper")
    models = corral.models()
    assert {n: models[n]["backend"] for n in ("chat", "coder", "helper")} == {
        "chat": "vllm", "coder": "vllm", "helper": "llama-server"}
    assert models["chat"]["model_path"] == "Qwen/Qwen2.5-7B-Instruct"
    resp = corral.chat("chat", max_tokens=4)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_start_failed"
    assert "command '/opt/vllm/bin/python' does not exist; install vLLM in a venv of its own" \
        in error["message"], error
    result = corral.http.post("/v1/batch/execute", timeout=180, json={
        "group": "duo", "messages": QUESTION, "max_tokens": 8}).json()
    outcome = {m["model"]: m["status"] for m in result["responses"]}
    assert outcome == {"chat": "error", "helper": "ok"} and result["complete"], result


def test_distributed_rpc_preset_splits_the_demo_model_over_two_local_workers(
        start_corral: CorralFactory, smol_model: Path) -> None:
    corral = serve_preset(start_corral, PRESETS / "distributed-rpc.yaml")
    ask_plain(corral, "big")  # through the two workers
    rpc = corral.model("big")["rpc"]
    assert [w["kind"] for w in rpc["deployed"]] == ["local", "local"]
    assert sum(w["layers"] for w in rpc["deployed"]) == 30  # SmolLM2-135M's layers
    info = corral.http.get("/admin/models/big/gguf").json()
    assert (info["architecture"], info["layers"]) == ("llama", 30)
    assert corral.model("huge")["rpc"]["workers"] == ["local", "box2"]

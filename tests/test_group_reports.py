"""Group results that say what happened, and images through every group type.

One daemon for the module; its members are scripted `backend: command` children
(tests/scripted_member.py) that answer a fixed text after a set delay, fail a set number of
starts, and write down every request they got: what a group sent each member is asserted
from what the member received, and a vote's outcome is known in advance."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.proxy import votes
from corral.proxy.groups import agreement_note

from conftest import Corral, CorralFactory, free_port, sse_lines

SCRIPT = Path(__file__).resolve().parent / "scripted_member.py"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A 1x1 PNG: what the members get is asserted, no member looks at it.
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
         "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
PICTURE = [{"role": "user", "content": [
    {"type": "text", "text": "What is in this picture?"},
    {"type": "image_url", "image_url": {"url": PIXEL}}]}]

pytestmark = pytest.mark.expect_log(
    "proxy.start_failed", "proxy.group_failed", "instance.start_failed",
    allow=r"scripted failure of start")


def member(folder: Path, name: str, reply: str = "ok", delay: float = 0.0,
           vision: bool = False, **extra: Any) -> dict[str, Any]:
    argv = [sys.executable, "-S", str(SCRIPT), "--port", "${PORT}", "--reply", reply,
            "--delay", str(delay), "--record", str(folder / f"{name}.jsonl")]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return {"backend": "command", "command": argv, "start_timeout": 20,
            **({"capabilities": ["chat", "vision"]} if vision else {})}


def received(folder: Path, name: str) -> list[dict[str, Any]]:
    """The request bodies `name` got, oldest first."""
    path = folder / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["body"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("members")


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, folder: Path, tiny_models: dict[str, Path],
           ) -> Corral:
    replies = {"paris-1": "Paris", "paris-2": "Paris", "paris-3": "Paris", "lyon": "Lyon",
               "rome": "Rome", "nice": "Nice", "bern": "Bern"}
    models: dict[str, Any] = {name: member(folder, name, reply)
                              for name, reply in replies.items()}
    models.update({
        "slow": member(folder, "slow", "Slow", delay=5),
        "late": member(folder, "late", "Late", delay=0.5),
        "broken": member(folder, "broken", fail_starts=1_000_000,
                         starts=folder / "broken.starts"),
        "flaky": member(folder, "flaky", "Flaky", fail_starts=1,
                        starts=folder / "flaky.starts"),
        "scribe": member(folder, "scribe", "Synthesized"),
        "eye": member(folder, "eye", "A red pixel", vision=True),
        "eye2": member(folder, "eye2", "A small red dot", vision=True),
        "blind": member(folder, "blind", "Polished"),
        # Never started: the 400s below come before anything starts.
        "native": {"model": str(tiny_models["tiny-a"]), "ctx": 2048},
        "far": {"backend": "remote", "url": f"http://127.0.0.1:{free_port()}/v1"},
    })

    def fan(*names: str, **more: Any) -> dict[str, Any]:
        return {"models": list(names), "type": "fan_out", **more}

    groups = {
        "quick": fan("paris-1", "slow"),
        "apart": fan("paris-1", "lyon", "rome", "nice", "bern", selector="majority"),
        "most": fan("paris-1", "paris-2", "lyon", "rome", "nice", selector="majority"),
        "half": fan("paris-1", "paris-2", "paris-3", "lyon", "rome", selector="majority"),
        "council": {"models": ["paris-1", "lyon", "rome"], "type": "consensus",
                    "synthesizer": "scribe", "compare": {"extract": {"last_line": True}}},
        "need-two": {"models": ["paris-1", "paris-2", "broken"], "required_responses": 2},
        "need-three": {"models": ["paris-1", "paris-2", "broken"]},
        "retry": {"models": ["paris-1", "flaky"], "fallback": "retry_once"},
        "strict-first": fan("broken", "late"),
        "strict-first-two": fan("broken", "late", "paris-1", required_responses=2),
        "strict-first-short": fan("broken", "late", required_responses=2),
        "look-then-polish": {"models": ["eye", "blind"], "type": "chain",
                             "template": "Improve: {previous}"},
        "look-twice": {"models": ["eye", "eye2"], "type": "chain",
                       "template": "Question: {input}\nDraft: {previous}"},
        "blind-first": {"models": ["blind", "eye"], "type": "chain", "fallback": "partial"},
        "look-partial": {"models": ["eye", "blind"], "fallback": "partial"},
        "look-strict": {"models": ["eye", "blind"], "expose_as_model": True},
        "look-replace": {"models": ["eye", "blind"], "fallback": "replace_with",
                         "replace_with": {"blind": "eye2"}},
    }
    return start_corral_module({"defaults": {"ttl": 300, "stop_grace": 5},
                                "policy": {"max_loaded": 20},
                                "models": models, "groups": groups})


def run(corral: Corral, group: str, messages: list[dict[str, Any]] | None = None,
        ) -> tuple[int, dict[str, Any]]:
    resp = corral.http.post("/v1/batch/execute",
                            json={"group": group, "messages": messages or QUESTION})
    return resp.status_code, resp.json()


def group_runs(corral: Corral) -> dict[tuple[str, str], float]:
    """corral_group_requests_total by (group, result)."""
    text = corral.http.get("/metrics").text
    return {(s.labels["group"], s.labels["result"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "corral_group_requests_total"}


def last_group_event(corral: Corral) -> dict[str, Any]:
    """The most recent `group` event, as /admin/events replays it."""
    with corral.http.stream("GET", "/admin/events", params={"kinds": "group", "last": 1},
                            timeout=10) as resp:
        for line in sse_lines(resp):
            if line.startswith("data: "):
                event: dict[str, Any] = json.loads(line[6:])
                return event
    raise AssertionError("no group event")


# -- complete, partial and failed agree everywhere ---------------------------------------------

def test_a_first_ok_run_is_complete_in_the_answer_the_event_and_the_metrics(corral: Corral):
    status, result = run(corral, "quick")
    assert status == 200 and result["complete"] is True
    assert [m["status"] for m in result["responses"]] == ["ok", "cancelled"]
    event = last_group_event(corral)
    assert (event["group"], event["result"]) == ("quick", "ok"), event
    runs = group_runs(corral)
    assert runs.get(("quick", "ok")) == 1 and ("quick", "partial") not in runs, runs


# -- majority only when there is one -----------------------------------------------------------

def test_agreement_is_named_for_what_the_votes_show(corral: Corral):
    for group, agreement, agree in (("apart", "no_majority", 1), ("most", "plurality", 2),
                                    ("half", "majority", 3)):
        status, result = run(corral, group)
        assert status == 200, result
        vote = result["vote"]
        assert (vote["agreement"], vote["agree"], vote["of"]) == (agreement, agree, 5)
        reason = result["selected"]["reason"]
        assert reason.startswith(f"{agreement}: "), reason


def test_the_synthesizer_is_not_told_a_lone_answer_agrees(corral: Corral, folder: Path):
    status, result = run(corral, "council")
    assert status == 200 and result["vote"]["agreement"] == "no_majority"
    prompt = received(folder, "scribe")[-1]["messages"][-1]["content"]
    assert "Answers 1 agree" not in prompt
    assert "No two of the 3 answers agree" in prompt, prompt


def test_agreement_words_and_notes_in_a_pure_tally():
    def cast(*values: str | None) -> list[votes.Ballot]:
        return [votes.Ballot(i, f"m{i}", v) for i, v in enumerate(values)]

    singletons = votes.tally_by_value("exact", cast("a", "b", "c", "d", "e"))
    assert singletons.agreement == "no_majority"
    assert singletons.summary() == "no_majority: no two of 5 answers agree (exact)"
    tie = votes.tally_by_value("exact", cast("a", "b", "a", "b", "c"))
    assert tie.agreement == "no_majority"
    assert tie.summary() == "no_majority: 2 blocs of 2 of 5 answers tie (exact)"
    plurality = votes.tally_by_value("exact", cast("a", "b", "a", "c", "d"))
    assert plurality.agreement == "plurality"
    assert plurality.summary() == "plurality: 2 of 5 answers agree, more than any other " \
                                  "answer but not a majority (exact)"
    majority = votes.tally_by_value("exact", cast("a", "b", "a", "a", "d"))
    assert majority.summary() == "majority: 3 of 5 answers agree (exact)"
    number = {i: i + 1 for i in range(5)}
    assert agreement_note(singletons, number) == \
        "No two of the 5 answers agree (compared by exact).\n\n"
    assert agreement_note(tie, number).startswith(
        "No answer has a majority: answers 1, 3 agree, and so do answers 2, 4 (compared by "
        "exact)")
    assert agreement_note(plurality, number).startswith(
        "Answers 1, 3 agree (2 of 5, compared by exact: 'a'), more than any other answer but "
        "not a majority; answers 2, 4, 5 differ")
    assert agreement_note(majority, number).startswith("Answers 1, 3, 4 agree (3 of 5")


# -- required_responses decides under strict ---------------------------------------------------

def test_required_responses_decides_a_strict_group(corral: Corral):
    status, result = run(corral, "need-two")
    assert status == 200 and result["complete"] is True, result
    assert [m["status"] for m in result["responses"]] == ["ok", "ok", "error"]
    assert result["responses"][2]["error"]
    status, failed = run(corral, "need-three")
    assert status == 502 and failed["error"]["code"] == "group_failed"
    assert failed["group"]["complete"] is False
    assert "2 of 3 members answered, 3 required" in failed["error"]["message"]


# -- retry_once really retries -----------------------------------------------------------------

def test_retry_once_starts_a_member_again_despite_the_start_back_off(corral: Corral):
    status, result = run(corral, "retry")
    assert status == 200, result
    flaky = result["responses"][1]
    assert flaky["status"] == "retried" and flaky["content"] == "Flaky", flaky
    assert "first attempt failed" in flaky["error"]
    assert result["complete"] is True


# -- first_ok under strict is decided by the count, not the order ------------------------------

def test_strict_first_ok_is_decided_by_how_many_answered(corral: Corral):
    status, result = run(corral, "strict-first")  # broken fails first, late answers
    assert status == 200, result
    assert [m["status"] for m in result["responses"]] == ["error", "ok"]
    assert result["selected"]["model"] == "late" and result["complete"] is True
    status, result = run(corral, "strict-first-two")
    assert status == 200, result
    assert [m["status"] for m in result["responses"]] == ["error", "ok", "ok"]
    assert result["selected"]["model"] == "paris-1"  # the first to arrive of the two
    status, failed = run(corral, "strict-first-short")
    assert status == 502 and failed["error"]["code"] == "group_failed"
    assert [m["status"] for m in failed["group"]["responses"]] == ["error", "ok"]


# -- images through chains and groups ----------------------------------------------------------

def user_content(body: dict[str, Any]) -> Any:
    return [m for m in body["messages"] if m["role"] == "user"][-1]["content"]


def test_a_chain_carries_the_picture_to_the_steps_that_see(corral: Corral, folder: Path):
    status, result = run(corral, "look-then-polish", PICTURE)
    assert status == 200, result
    first, second = result["steps"] if "steps" in result else result["responses"]
    assert (first["images"], first["input"]) == (1, "What is in this picture?")
    eye = user_content(received(folder, "eye")[-1])
    assert eye == PICTURE[0]["content"]  # the text and the image, as the user sent them
    # The text model polishes the description: text only, and no image anywhere.
    assert (second["images"], second["input"]) == (0, "Improve: A red pixel")
    blind = received(folder, "blind")[-1]
    assert user_content(blind) == "Improve: A red pixel"
    assert "image_url" not in json.dumps(blind)

    status, result = run(corral, "look-twice", PICTURE)
    assert status == 200, result
    eye2 = user_content(received(folder, "eye2")[-1])
    assert eye2 == [{"type": "text", "text": "Question: What is in this picture?\n"
                                             "Draft: A red pixel"},
                    {"type": "image_url", "image_url": {"url": PIXEL}}]


def test_a_chain_skips_a_blind_step_before_any_step_has_seen(corral: Corral, folder: Path):
    before = len(received(folder, "blind"))
    status, result = run(corral, "blind-first", PICTURE)
    assert status == 200, result
    blind, eye = result["responses"]
    assert blind["status"] == "skipped" and "vision" in blind["error"], blind
    assert eye["status"] == "ok" and eye["images"] == 1
    assert result["complete"] is False and result["final"] == "A red pixel"
    assert len(received(folder, "blind")) == before


def test_a_member_without_vision_is_skipped_refused_or_replaced(corral: Corral, folder: Path):
    blind_before, eye_before = len(received(folder, "blind")), len(received(folder, "eye"))
    status, result = run(corral, "look-partial", PICTURE)
    assert status == 200, result
    eye, blind = result["responses"]
    assert (eye["status"], eye["images"]) == ("ok", 1)
    assert blind["status"] == "skipped" and "cannot see images" in blind["error"]
    assert result["complete"] is False
    assert last_group_event(corral)["result"] == "partial"
    assert group_runs(corral).get(("look-partial", "partial")) == 1

    status, refused = run(corral, "look-strict", PICTURE)
    assert status == 400, refused
    assert refused["error"]["code"] == "vision_unsupported"
    assert "'blind'" in refused["error"]["message"]
    assert "capabilities: [chat, vision]" in refused["error"]["message"]
    assert len(received(folder, "eye")) == eye_before + 1  # only look-partial's call

    # The same refusal for the group used as a model, streamed, and for a chain named ad hoc
    # (strict) whose first step cannot see.
    resp = corral.http.post("/v1/chat/completions", json={
        "model": "look-strict", "messages": PICTURE, "stream": True})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "vision_unsupported"
    resp = corral.http.post("/v1/chain/execute", json={
        "models": ["blind", "eye"], "messages": PICTURE})
    assert resp.status_code == 400 and "'blind'" in resp.json()["error"]["message"]
    assert len(received(folder, "eye")) == eye_before + 1

    status, result = run(corral, "look-replace", PICTURE)
    assert status == 200, result
    eye, stand_in = result["responses"]
    assert (stand_in["status"], stand_in["model"], stand_in["replaced"]) == (
        "replaced", "eye2", "blind")
    assert stand_in["images"] == 1 and result["complete"] is True
    assert len(received(folder, "blind")) == blind_before


# -- the single request's refusal --------------------------------------------------------------

def test_the_vision_refusal_names_the_fix_for_the_backend_and_the_field(corral: Corral):
    def refused(path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = corral.http.post(path, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "vision_unsupported"
        return error

    chat = {"messages": PICTURE}
    assert "mmproj:" in refused("/v1/chat/completions", {"model": "native", **chat})["message"]
    for name in ("blind", "far"):
        error = refused("/v1/chat/completions", {"model": name, **chat})
        assert "capabilities: [chat, vision]" in error["message"] and "mmproj" not in \
            error["message"]
        assert error["param"] == "messages"
    # An image placed directly in Responses' input, not inside a message.
    error = refused("/v1/responses", {"model": "blind", "input": [
        {"role": "user", "content": "What is in this picture?"},
        {"type": "input_image", "image_url": PIXEL}]})
    assert error["param"] == "input"
    error = refused("/v1/responses", {"model": "blind", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": PIXEL}]}]})
    assert error["param"] == "input"
    error = refused("/v1/messages", {"model": "blind", "max_tokens": 8, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PIXEL.split(",", 1)[1]}},
            {"type": "text", "text": "What is it?"}]}]})
    assert error["param"] == "messages"
    # A picture a tool returned, inside a tool_result block.
    error = refused("/v1/messages", {"model": "blind", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PIXEL.split(",", 1)[1]}}]}]}]})
    assert error["param"] == "messages"

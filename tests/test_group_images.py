"""Images through corral to a real vision child: single requests on the chat and Responses
paths, a chain and a fan-out with vision members, and the refusals where a model cannot see.

The vision models run llama-server with a tiny random projector (tests/tinyvision.py), which
encodes a picture into IMAGE_TOKENS prompt positions. "The child saw the image" is read in the
tokens it counted: a request with the image counts at least IMAGE_TOKENS more than the same
text without it, replayed to the same model (what the tiny model writes is noise).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import tiny_config, wait_until
from tinyvision import IMAGE_TOKENS, png_data_url

IMAGE = png_data_url()
QUESTION = "What is in this picture?"


def parts(text: str, image: bool) -> list[dict[str, Any]]:
    """One user turn as chat content parts, with or without the picture."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image:
        content.append({"type": "image_url", "image_url": {"url": IMAGE}})
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def corral(start_corral_module, tiny_models, tiny_vision):
    model, mmproj = tiny_vision
    eye = {"model": str(model), "mmproj": str(mmproj), "ctx": 4096}
    config = tiny_config(tiny_models, ["tiny-a"])
    config["models"] = {"eye": eye, "eye2": dict(eye),
                        "blind": config["models"]["tiny-a"]}
    config["groups"] = {
        # Each step sees the picture with its own input: the question, then the last answer.
        "look-twice": {"type": "chain", "models": ["eye", "eye2"], "expose_as_model": True},
        # One member can see, one cannot: the blind one is left out of an image request.
        "glance": {"type": "fan_out", "models": ["blind", "eye"], "selector": "longest",
                   "fallback": "partial", "expose_as_model": True},
        "glance-strict": {"type": "fan_out", "models": ["blind", "eye"],
                          "selector": "longest", "fallback": "strict", "expose_as_model": True},
        "glance-backup": {"type": "fan_out", "models": ["blind", "eye"], "selector": "longest",
                          "fallback": "replace_with", "replace_with": {"blind": "eye2"}},
        "mixed-chain": {"type": "chain", "models": ["eye", "blind", "eye2"],
                        "fallback": "partial"},
    }
    return start_corral_module(config)


def tokens_seen(corral, model: str, text: str, image: bool) -> int:
    """The prompt tokens `model` counts for `text` alone (or with the picture) as one request."""
    resp = corral.http.post("/v1/chat/completions", json={
        "model": model, "messages": parts(text, image), "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


def assert_saw_image(corral, model: str, text: str, counted: int) -> None:
    without = tokens_seen(corral, model, text, image=False)
    assert counted >= without + IMAGE_TOKENS, (model, counted, without)


def images_refused_by_child(corral, model: str) -> int:
    """How often `model`'s llama-server (no projector) was sent an image and refused it: what
    corral must never let happen, since it knows the model cannot see. The child's log reaches
    corral a moment after its answer: a text request of our own, logged after anything sent
    before it, is waited for first."""
    def count(text: str) -> int:
        lines = corral.http.get(f"/admin/models/{model}/logs",
                                params={"lines": 500}).json()["lines"]
        return sum(text in line for line in lines)

    released = count("stop processing")
    assert tokens_seen(corral, model, "hi", image=False) > 0
    wait_until(lambda: count("stop processing") > released)
    return count("image input is not supported")


# -- one model --------------------------------------------------------------------------------

def test_a_model_with_mmproj_is_listed_as_vision(corral):
    listed = {m["id"]: m for m in corral.http.get("/v1/models").json()["data"]}
    assert "vision" in listed["eye"]["capabilities"]
    assert "vision" not in listed["blind"]["capabilities"]


def test_an_image_on_chat_reaches_the_vision_child(corral):
    with_image = tokens_seen(corral, "eye", QUESTION, image=True)
    assert_saw_image(corral, "eye", QUESTION, with_image)


def test_an_input_image_on_responses_reaches_the_vision_child(corral):
    def input_tokens(image: bool) -> int:
        content: list[dict[str, Any]] = [{"type": "input_text", "text": QUESTION}]
        if image:
            content.append({"type": "input_image", "image_url": IMAGE})
        resp = corral.http.post("/v1/responses", json={
            "model": "eye", "input": [{"role": "user", "content": content}],
            "max_output_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["input_tokens"])

    assert input_tokens(image=True) >= input_tokens(image=False) + IMAGE_TOKENS


def test_an_image_to_a_model_without_vision_is_refused_on_chat(corral):
    resp = corral.http.post("/v1/chat/completions", json={
        "model": "blind", "messages": parts(QUESTION, image=True), "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("vision_unsupported", "messages")
    assert "mmproj" in error["message"]  # a llama-server model's fix is a projector


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                 {"type": "input_image", "image_url": IMAGE}]},
    {"type": "message", "role": "user",
     "content": [{"type": "input_image", "image_url": IMAGE}]},
    {"type": "input_image", "image_url": IMAGE},  # an input item that is itself an image
], ids=["easy-message", "typed-message", "bare-part"])
def test_an_image_to_a_model_without_vision_is_refused_on_responses(corral, item):
    resp = corral.http.post("/v1/responses", json={
        "model": "blind", "input": [item], "max_output_tokens": 1})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("vision_unsupported", "input")


def anthropic_image() -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": IMAGE.split(",", 1)[1]}}


def test_an_image_block_on_messages_reaches_the_vision_child(corral):
    def input_tokens(image: bool) -> int:
        content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
        if image:
            content.append(anthropic_image())
        resp = corral.http.post("/v1/messages", json={
            "model": "eye", "messages": [{"role": "user", "content": content}],
            "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        # Anthropic's input_tokens leaves out what the prompt cache read.
        return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)

    assert input_tokens(image=True) >= input_tokens(image=False) + IMAGE_TOKENS


def test_an_image_block_to_a_model_without_vision_is_refused_on_messages(corral):
    resp = corral.http.post("/v1/messages", json={
        "model": "blind", "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                  anthropic_image()]}]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("vision_unsupported", "messages")


# -- a chain ----------------------------------------------------------------------------------

def test_a_chain_without_an_image_counts_what_a_single_request_counts(corral):
    """The yardstick the image tests use: a step's tokens equal its input replayed alone."""
    result = corral.http.post("/v1/chain/execute", json={
        "group": "look-twice", "messages": parts(QUESTION, image=False),
        "max_tokens": 8, "temperature": 0}).json()
    steps = result["steps"]
    assert [s["status"] for s in steps] == ["ok", "ok"], steps
    for step in steps:
        assert step["usage"]["prompt_tokens"] == tokens_seen(
            corral, step["model"], step["input"], image=False), step


def test_a_chain_carries_the_image_to_every_vision_step(corral):
    resp = corral.http.post("/v1/chain/execute", json={
        "group": "look-twice", "messages": parts(QUESTION, image=True),
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    steps = resp.json()["steps"]
    assert [(s["model"], s["status"]) for s in steps] == [("eye", "ok"), ("eye2", "ok")], steps
    assert steps[0]["input"].strip() == QUESTION
    for step in steps:
        assert_saw_image(corral, step["model"], step["input"], step["usage"]["prompt_tokens"])


def test_a_chain_exposed_as_a_model_takes_an_image_on_chat(corral):
    resp = corral.http.post("/v1/chat/completions", json={
        "model": "look-twice", "messages": parts(QUESTION, image=True),
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "look-twice"
    details = body["corral_group"]
    last = details.get("steps", details.get("responses"))[-1]
    assert last["status"] == "ok"
    assert_saw_image(corral, last["model"], last["input"], last["usage"]["prompt_tokens"])


# -- a fan-out --------------------------------------------------------------------------------

def test_a_fan_out_gives_the_image_to_its_vision_member_and_leaves_out_the_blind_one(corral):
    refused_before = images_refused_by_child(corral, "blind")
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "glance", "messages": parts(QUESTION, image=True),
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    result = resp.json()
    blind, eye = result["responses"]
    assert (blind["model"], eye["model"]) == ("blind", "eye")
    assert eye["status"] == "ok"
    assert_saw_image(corral, "eye", QUESTION, eye["usage"]["prompt_tokens"])
    # The blind member never got the picture (corral left it out, its child never refused
    # it), and the report says why.
    assert blind["status"] != "ok" and blind["content"] in (None, "")
    assert "vision" in blind["error"] or "image" in blind["error"], blind
    assert images_refused_by_child(corral, "blind") == refused_before
    assert result["selected"]["model"] == "eye"


def test_a_fan_out_without_an_image_asks_every_member(corral):
    result = corral.http.post("/v1/batch/execute", json={
        "group": "glance", "messages": parts(QUESTION, image=False),
        "max_tokens": 8, "temperature": 0}).json()
    assert [r["status"] for r in result["responses"]] == ["ok", "ok"], result
    assert result["complete"] is True


def test_a_fan_out_exposed_as_a_model_answers_an_image_from_its_vision_member(corral):
    resp = corral.http.post("/v1/chat/completions", json={
        "model": "glance", "messages": parts(QUESTION, image=True),
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    details = resp.json()["corral_group"]
    assert details["selected"]["model"] == "eye"
    eye = details["responses"][1]
    assert_saw_image(corral, "eye", QUESTION, eye["usage"]["prompt_tokens"])


def test_a_strict_fan_out_with_a_blind_member_refuses_an_image(corral):
    refused_before = images_refused_by_child(corral, "blind")
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "glance-strict", "messages": parts(QUESTION, image=True), "max_tokens": 8})
    # Refused as the same request to the blind model alone is, before any member starts.
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("vision_unsupported", "messages"), error
    assert "blind" in error["message"] and "image" in error["message"], error
    # Asked as a model on /v1/responses, the field named is the client's own: `input`.
    resp = corral.http.post("/v1/responses", json={
        "model": "glance-strict", "max_output_tokens": 8, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                         {"type": "input_image", "image_url": IMAGE}]}]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("vision_unsupported", "input"), error
    assert images_refused_by_child(corral, "blind") == refused_before


def test_a_fan_out_replaces_a_blind_member_with_its_vision_backup(corral):
    refused_before = images_refused_by_child(corral, "blind")
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "glance-backup", "messages": parts(QUESTION, image=True),
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    stand_in, eye = resp.json()["responses"]
    assert (stand_in["model"], stand_in["status"], stand_in["replaced"]) == (
        "eye2", "replaced", "blind"), stand_in
    for member in (stand_in, eye):
        assert_saw_image(corral, member["model"], QUESTION, member["usage"]["prompt_tokens"])
    assert images_refused_by_child(corral, "blind") == refused_before


# -- a chain with a blind step -----------------------------------------------------------------

def test_a_chain_never_shows_a_blind_step_the_image_and_its_vision_steps_see_it(corral):
    refused_before = images_refused_by_child(corral, "blind")
    resp = corral.http.post("/v1/chain/execute", json={
        "group": "mixed-chain", "messages": parts(QUESTION, image=True),
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    steps = resp.json()["steps"]
    assert steps[0]["model"] == "eye" and steps[0]["status"] == "ok", steps
    # The blind step either works on the text alone or is left out, saying why; either way
    # its child is never sent the picture.
    blind = next(s for s in steps if s["model"] == "blind")
    assert blind["status"] == "ok" or "vision" in blind["error"] or "image" in blind["error"]
    for step in steps:
        if step["status"] == "ok" and step["model"] != "blind":
            assert_saw_image(corral, step["model"], step["input"], step["usage"]["prompt_tokens"])
    assert images_refused_by_child(corral, "blind") == refused_before

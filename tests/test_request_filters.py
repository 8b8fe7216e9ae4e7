"""Request filters (`request: {defaults, set, strip, system_prompt}`), observed through the
child: the tiny models' vocabulary is one token per byte and their chat template writes
"role: content\\n" per message, so a system prompt the child received shows as exactly its
bytes more prompt tokens (a space being "▁", 3 bytes), and max_tokens as completion tokens.
And the embedded default: README's own curl body, as printed, answers "Paris" from the demo
model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from corral.proxy.filters import apply
from corral.supervisor.config.schema.request import RequestFilters

from conftest import REPO, Corral, CorralFactory, tiny_config

SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-a2"], policy={"max_loaded": 4})
    models = config["models"]
    # tiny-a2 has tiny-a's weights and no filters: the reference the filtered ones differ from.
    models["filtered"] = {**models["tiny-a"], "request": {
        "defaults": {"max_tokens": 5}, "set": {"ignore_eos": True}, "system_prompt": SYSTEM}}
    models["stripped"] = {**models["tiny-a"], "request": {
        "strip": ["max_tokens", "logit_bias"], "defaults": {"max_tokens": 6},
        "set": {"ignore_eos": True}}}
    models["forced"] = {**models["tiny-a"], "request": {"set": {"max_tokens": 4,
                                                                "ignore_eos": True}}}
    config["groups"] = {"both": {"type": "parallel", "models": ["filtered", "forced"]}}
    return start_corral_module(config)


def ask(corral: Corral, model: str, messages: list[dict[str, str]] | None = None,
        **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": messages or [{"role": "user", "content": "hi"}], **extra}
    resp = corral.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def test_a_request_without_a_system_message_reaches_the_child_with_the_default_one(corral):
    plain = ask(corral, "tiny-a2", max_tokens=1)["usage"]["prompt_tokens"]
    filtered = ask(corral, "filtered", max_tokens=1)["usage"]["prompt_tokens"]
    # The child counted the bytes of "system: Be brief.\n" more (its SPM tokenizer writes a
    # space as "▁", 3 bytes): it got the system message.
    assert filtered - plain == len(f"system: {SYSTEM}\n".replace(" ", "\u2581").encode())
    # A request with its own system message keeps it, and gets no second one.
    own = [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]
    assert ask(corral, "filtered", own, max_tokens=1)["usage"]["prompt_tokens"] \
        == ask(corral, "tiny-a2", own, max_tokens=1)["usage"]["prompt_tokens"]


def test_defaults_fill_what_the_client_left_out_and_set_overrides_it(corral):
    assert ask(corral, "filtered")["usage"]["completion_tokens"] == 5  # defaults.max_tokens
    assert ask(corral, "filtered", max_tokens=3)["usage"]["completion_tokens"] == 3  # client's
    # set wins over the client: 9 asked, 4 generated.
    assert ask(corral, "forced", max_tokens=9)["usage"]["completion_tokens"] == 4


def test_strip_removes_fields_before_the_child_sees_them(corral):
    # The client's max_tokens never reaches the child: stripped, then the model's default
    # fills the gap (strip comes first).
    assert ask(corral, "stripped", max_tokens=2, logit_bias={"65": 1})["usage"][
        "completion_tokens"] == 6


def test_a_stream_is_filtered_too(corral):
    client = corral.client()
    stream = client.chat.completions.create(
        model="forced", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
        stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage]
    assert usage and usage[-1].completion_tokens == 4


def test_each_group_member_gets_its_own_filters(corral):
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "both", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
    assert resp.status_code == 200, resp.text
    usage = {m["model"]: m["usage"]["completion_tokens"] for m in resp.json()["responses"]}
    # filtered keeps the client's 9 (its defaults yield to it); forced sets 4.
    assert usage == {"filtered": 9, "forced": 4}


def test_filters_apply_in_order_and_leave_the_clients_body_alone():
    filters = RequestFilters(defaults={"temperature": 0.2, "top_k": 5}, set={"top_k": 40},
                             strip=["logit_bias", "temperature"], system_prompt="S")
    body = {"model": "m", "temperature": 1.5, "logit_bias": {"1": 2},
            "messages": [{"role": "user", "content": "q"}]}
    out = apply(body, filters)
    # strip, then the defaults for what is missing (temperature, stripped, is missing), then set.
    assert out == {"model": "m", "temperature": 0.2, "top_k": 40,
                   "messages": [{"role": "system", "content": "S"},
                                {"role": "user", "content": "q"}]}
    assert body["temperature"] == 1.5 and "logit_bias" in body  # the original is untouched
    assert apply(body, None) is body
    # A developer message sets the stage like a system one; completions have no messages.
    dev = {"messages": [{"role": "developer", "content": "d"}]}
    assert apply(dev, RequestFilters(system_prompt="S")) is dev
    prompt = {"prompt": "p"}
    assert apply(prompt, RequestFilters(system_prompt="S"), "/v1/completions") is prompt


@pytest.mark.parametrize("request_section", [
    {"set": {"model": "other"}}, {"defaults": {"model": "x"}}, {"strip": ["model"]},
    {"strip": ["messages"]}, {"sett": {}},
])
def test_filters_that_would_break_routing_are_refused(request_section):
    with pytest.raises(ValidationError):
        RequestFilters.model_validate(request_section)


# -- the embedded default ------------------------------------------------------------------------

def readme_curl_body() -> dict[str, Any]:
    """The body of README's first curl example, exactly as printed."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"```sh\ncurl -s http://127\.0\.0\.1:8080/v1/chat/completions.*?-d '(.*?)'",
                      text, re.S)
    assert match, "README's curl example is gone"
    body: dict[str, Any] = json.loads(match.group(1))
    return body


def readme_sdk_example() -> str:
    """README's first Python example (the OpenAI SDK, streaming), exactly as printed."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(from openai import OpenAI.*?)```", text, re.S)
    assert match, "README's SDK example is gone"
    return match.group(1)


def test_readme_examples_answer_paris_from_the_embedded_default(
        start_corral: CorralFactory, smol_model: Path, tmp_path: Path) -> None:
    body = readme_curl_body()
    assert body["model"] == smol_model.stem
    # `corral serve` with no config: the embedded default, as `make run` starts it.
    corral = start_corral.spawn(["--models-dir", str(smol_model.parent)],
                                tmp_path / "none.yaml")
    url = corral.url
    # Cold start included: the model loads for this request. How long that takes is the
    # benches' to say (README's 2.4 s was a quiet 2-core VM; the suite's busy workers made
    # it 10.5 s once): the client's own timeout is the only bound here.
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert resp.json()["usage"]["completion_tokens"] <= 128  # the profile's cap
    # README's SDK example, as printed but for the port: streamed, it says Paris too.
    code = readme_sdk_example().replace("http://127.0.0.1:8080", url)
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert "Paris" in printed.stdout, printed.stdout

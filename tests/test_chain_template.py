"""Chain templates: only {previous} and {input}, never str.format over client text."""

from __future__ import annotations

import time

import pytest

from corral.supervisor.templates import TemplateError, render_template, template_problem

from conftest import tiny_config

HOSTILE = ["{input:>50000000}", "{input.__class__}"]


@pytest.mark.parametrize("template", [
    *HOSTILE, "{nope}", "{input!r}", "{previous[0]}", "{}", "{0}", "{ input }", "{input",
    "input}", "a } b", "{{input}", "{input:}", "{previous:{input}}", "{" * 3])
def test_anything_but_the_two_fields_is_a_problem(template):
    problem = template_problem(template)
    assert problem and ("{previous}" in problem or "'}}'" in problem), problem
    with pytest.raises(TemplateError):
        render_template(template, previous="p", input="i")


@pytest.mark.parametrize(("template", "rendered"), [
    ("{previous}", "P"),
    ("Q: {input}\nDraft: {previous}\nImprove it.", "Q: I\nDraft: P\nImprove it."),
    ("{{input}} is {input}", "{input} is I"),  # doubled braces are literal, as with format
    ("{{{input}}}", "{I}"),
    ('{{"json": "{previous}"}}', '{"json": "P"}'),
    ("no fields", "no fields"),
    ("", ""),
])
def test_valid_templates_render_as_str_format_did(template, rendered):
    assert template_problem(template) is None
    assert render_template(template, previous="P", input="I") == rendered
    assert template.format(previous="P", input="I") == rendered


def test_values_are_not_parsed_again():
    assert render_template("{previous}|{input}", previous="{input}", input="{previous:>9}") \
        == "{input}|{previous:>9}"


def test_hostile_problems_name_the_field_briefly():
    assert "{input:>50000000}" in (template_problem("{input:>50000000}") or "")
    long = "{" + "x" * 10_000 + "}"
    assert len(template_problem(long) or "") < 400


def test_rendering_stays_linear():
    big = "{input}" * 20_000 + "{{x}}" * 20_000
    started = time.perf_counter()
    assert template_problem(big) is None
    out = render_template(big, previous="", input="ab")
    assert time.perf_counter() - started < 1
    assert len(out) == 20_000 * 2 + 20_000 * 3


def test_chain_refuses_hostile_templates_before_starting_anything(start_corral, tiny_models):
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"])
    config["groups"] = {"pipe": {"models": ["tiny-a", "tiny-b"], "type": "chain",
                                 "expose_as_model": True}}
    corral = start_corral(config)
    hi = [{"role": "user", "content": "hi"}]
    for template in HOSTILE:
        for target in ({"models": ["tiny-a", "tiny-b"]}, {"group": "pipe"}):
            started = time.monotonic()
            resp = corral.http.post("/v1/chain/execute", json={
                **target, "messages": hi, "max_tokens": 4, "template": template})
            assert time.monotonic() - started < 1
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert (error["code"], error["param"], error["type"]) == (
                "invalid_template", "template", "invalid_request_error")
            assert template in error["message"]
        # An exposed chain group takes a request's template on the chat route too.
        resp = corral.chat("pipe", template=template, max_tokens=4)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_template"
    assert {m["state"] for m in corral.models().values()} == {"stopped"}

    ok = corral.http.post("/v1/chain/execute", json={
        "models": ["tiny-a", "tiny-b"], "messages": hi, "max_tokens": 4, "temperature": 0,
        "template": "{{Q}}: {input} / {previous}"})
    assert ok.status_code == 200, ok.text
    first, second = ok.json()["steps"]
    assert second["input"] == f"{{Q}}: hi / {first['content']}"

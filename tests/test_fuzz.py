"""Fuzzing every POST endpoint of one real corral (real llama-server children on tiny models),
the pull and router APIs, any path under /v1, and the read endpoints' queries:
random JSON shapes, wrong types, ~1 MB strings, invalid UTF-8, deep nesting, wrong content
types, hostile model names. Never a 500, only documented statuses, every error in the OpenAI
shape, and the daemon healthy afterwards. A valid request, drawn unchanged from the valid set,
is served: 200 with a whole answer, whatever else is fuzzed beside it."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from conftest import Corral, tiny_config

# Hostile input makes these happen, each a documented answer to the client (the oracle checks
# it): a group or child refusing a body, a start or pull that cannot work. Tracebacks, errors
# and anything else in the daemon's log still fail the module.
pytestmark = pytest.mark.expect_log("proxy.group_failed", "proxy.request_failed",
                                    "proxy.upstream_failed", "proxy.start_failed",
                                    "pull.failed")

KEY = "fuzz-key"
HI = [{"role": "user", "content": "hi"}]
V1_POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/batch/execute",
            "/v1/chain/execute"]
DOCUMENTED = {200, 400, 401, 404, 413, 415, 429, 502, 503, 504}
JSON = {"Content-Type": "application/json"}
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# No shrinking: every example is a round trip to a real daemon, and shrinking one failure
# takes minutes (past pytest's timeout, which would lose the example); it is reported as found.
FUZZ = settings(deadline=None, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def corral(start_corral_module, tiny_models, tmp_path_factory) -> Corral:
    """One daemon for the whole module: thousands of requests, one start."""
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b", "tiny-c"], api_keys=[KEY],
                         max_body_mb=4, models_dir=str(tmp_path_factory.mktemp("fuzz-models")))
    for model in config["models"].values():
        model["ctx"] = 1024  # a valid request's prompt and its two tokens fit; more is refused
    config["models"]["tiny-c"].update(embeddings=True, args=["--pooling", "mean"])
    config["groups"] = {"pair": {"models": ["tiny-a", "tiny-b"], "expose_as_model": True,
                                 "fallback": "partial"},
                        "pipe": {"models": ["tiny-a", "tiny-b"], "type": "chain"}}
    return start_corral_module(config, api_key=KEY)


def check(resp: httpx.Response, sent_id: str | None = None,
          also: frozenset[int] = frozenset()) -> None:
    """What every answer to anything must look like (`also`: an endpoint's own successes and
    refusals, such as a pull's 202 and 409)."""
    status = resp.status_code
    assert status in DOCUMENTED | also, (status, resp.text[:500])
    rid = resp.headers.get("x-request-id", "")
    assert REQUEST_ID.fullmatch(rid), resp.headers
    if sent_id is not None and REQUEST_ID.fullmatch(sent_id):
        assert rid == sent_id
    if status in (200, 202):
        return
    assert resp.headers["content-type"].startswith("application/json"), resp.text[:300]
    error = resp.json()["error"]
    assert isinstance(error, dict) and set(error) >= {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    if status >= 500:
        assert error["message"].endswith(f"(request id {rid})"), error["message"]


# -- strategies --------------------------------------------------------------------------------

leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**63)
          | st.floats(allow_nan=False) | st.text(max_size=24))
json_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)
names = st.sampled_from(["tiny-a", "tiny-b", "pair", "pipe", "nope", "", "TINY-A"]) | st.text(
    max_size=30)
parts = st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values,
                                        "text": st.text(max_size=30) | json_values}),
                 max_size=2)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
    optional={"content": st.text(max_size=40) | parts | json_values, "name": json_values,
              "tool_calls": json_values})
FIELDS = {
    "model": names | json_values,
    "messages": st.lists(message, min_size=1, max_size=3) | json_values,
    "max_tokens": json_values,
    "temperature": st.floats(0, 2) | json_values,
    "stream": st.booleans() | json_values,
    "group": st.sampled_from(["pair", "pipe", "nope"]) | json_values,
    "models": st.lists(names, max_size=3) | json_values,
    "template": st.sampled_from(["{previous}!", "{input} {previous}", "{nope}", "{"])
    | json_values,
    "prompt": st.text(max_size=30) | json_values,
    "input": st.text(max_size=30) | st.lists(st.text(max_size=8), max_size=2) | json_values,
    "n": json_values,
    "stop": json_values,
    "tools": json_values,
}
bodies = st.builds(lambda known, extra: {**extra, **known},
                   st.fixed_dictionaries({}, optional=FIELDS),
                   st.dictionaries(st.text(max_size=10), json_values, max_size=2))
auth = st.sampled_from([f"Bearer {KEY}"] * 6 + ["", "Bearer nope", f"Basic {KEY}",
                                                 f"bearer {KEY}", "Bearer"])
request_ids = st.none() | st.sampled_from(["fuzz-1", "a" * 64, "a" * 65, "x y", "é"]) | st.text(
    st.characters(min_codepoint=33, max_codepoint=126), max_size=70)


VALID = {
    "/v1/chat/completions": st.fixed_dictionaries({
        "model": st.sampled_from(["tiny-a", "tiny-b", "pair"]), "messages": st.just(HI)}),
    "/v1/completions": st.fixed_dictionaries({"model": st.just("tiny-b"),
                                              "prompt": st.just("hi")}),
    "/v1/embeddings": st.fixed_dictionaries({"model": st.just("tiny-c"),
                                             "input": st.just("hi")}),
    "/v1/batch/execute": st.fixed_dictionaries({"group": st.sampled_from(["pair", "pipe"]),
                                                "messages": st.just(HI)}),
    "/v1/chain/execute": st.fixed_dictionaries({"group": st.just("pipe"),
                                                "messages": st.just(HI)})
    | st.fixed_dictionaries({"models": st.lists(st.sampled_from(["tiny-a", "tiny-b"]),
                                                min_size=1, max_size=2),
                             "messages": st.just(HI)}),
}


@st.composite
def valid(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A request from the valid set, as it is (streamed or not): it must be served."""
    endpoint = draw(st.sampled_from(V1_POSTS))
    return endpoint, {"max_tokens": 2, "stream": draw(st.booleans()), **draw(VALID[endpoint])}


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[str, dict[str, Any], bool]:
    """A valid request for an endpoint with a field or two changed, added or dropped: the
    random bodies alone almost never get past the first check to the children. The flag
    says whether it still is the valid request it was drawn as (nothing changed)."""
    endpoint, original = draw(valid())
    body = dict(original)
    for field in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(FIELDS[field])
    return endpoint, body, body == original


# What a served request's answer holds, by endpoint (a stream: events ending in [DONE]).
ANSWER_KEY = {"/v1/chat/completions": "choices", "/v1/completions": "choices",
              "/v1/embeddings": "data", "/v1/batch/execute": "responses",
              "/v1/chain/execute": "steps"}


def assert_served(endpoint: str, resp: httpx.Response) -> None:
    """A valid request's answer: 200, and a whole one (no error inside a 200)."""
    assert resp.status_code == 200, (endpoint, resp.status_code, resp.text[:500])
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[5:].strip() for line in resp.text.splitlines()
                  if line.startswith("data:")]
        assert events and events[-1] == "[DONE]", resp.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and not any("error" in c for c in chunks), resp.text[:500]
        return
    answer = resp.json()
    assert answer.get(ANSWER_KEY[endpoint]), answer
    if endpoint in ("/v1/batch/execute", "/v1/chain/execute"):
        assert answer["complete"] is True, answer


def seen(resp: httpx.Response) -> httpx.Response:
    event(f"HTTP {resp.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    return resp


def tame(body: dict[str, Any]) -> dict[str, Any]:
    """Whatever else is random, a valid request generates two tokens, not thousands."""
    for field, small in (("max_tokens", 2), ("n", 1)):
        value = body.get(field)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            body[field] = small
    return body


def headers(authorization: str, request_id: str | None,
            content_type: str = "application/json") -> dict[str, str | bytes]:
    out: dict[str, str | bytes] = {"Authorization": authorization, "Content-Type": content_type}
    if request_id is not None:
        out["X-Request-Id"] = request_id.encode()  # as a client may send it: any bytes
    return out


MB = 1_000_000
# ~1 MB strings go where corral itself must cope with them. A prompt that size is not sent to
# a child: llama-server's tokenizer is quadratic on these tiny models' vocabulary (100 kB takes
# 2.4 s, 1 MB minutes), which is the child's cost, not corral's.
HUGE = [
    {"model": "x" * MB, "messages": HI},
    {"group": "g" * MB, "messages": HI},
    {"models": ["tiny-a"], "messages": HI, "template": "{" + "t" * MB},
    {"model": "tiny-a", "messages": [{"role": "r" * MB, "content": 5}]},
    {"k" * MB: 1, "model": "nope"},
    {"model": "tiny-a", "messages": [{"role": "user", "content": "x" * 50_000}],
     "max_tokens": 2},
    {"model": "tiny-a", "padding": "p" * (5 * MB)},  # over max_body_mb: 413
]
RAW_SHAPES = [
    b"[" * 100_000,  # measured: RecursionError → plain 500
    b'{"a":' * 100_000,
    b'{"model": "tiny-a", "messages": ' + b"[" * 900 + b"]" * 900 + b"}",
    json.dumps({"messages": ["x"], "models": ["tiny-a"]}).encode(),  # measured: plain 500
    json.dumps({"messages": ["x"], "group": "pipe"}).encode(),
    *(json.dumps(body).encode() for body in HUGE),
    b'{"model": "tiny-a", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'{"model": "tiny-a", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"model": "tiny-a", "max_tokens": NaN}',
    b'{"model": "tiny-a", "max_tokens": 1e999}',
    b'{"model": "tiny-a", "max_tokens": 1' + b"0" * 5000 + b"}",
    "\ufeff{}".encode(),
    '{"model": "tiny-a"}'.encode("utf-16"),
    b"",
    b"null",
    b'"string"',
    b"model=tiny-a&messages=hi",
    b"--zz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny-a\r\n--zz--\r\n",
]
CONTENT_ENCODINGS = [None, None, None, "gzip", "deflate", "br", "identity", "bogus"]
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=zz", "application/json; charset=utf-16", "",
                 "application/octet-stream"]
HOSTILE_NAMES = ["..", "../tiny-a", "tiny-a/../tiny-b", "%2e%2e", "tiny-a%00", "tiny-a\x00",
                 "ü", "🦙", " ", "tiny-a?x=1", "tiny-a#frag", "a" * 4000, "tiny-a\n", "%ff%fe",
                 "${HOME}", "tiny-a.gguf", "/etc/passwd", "\\..\\"]


# -- the fuzzing -------------------------------------------------------------------------------

@settings(FUZZ, max_examples=600)
@given(endpoint=st.sampled_from(V1_POSTS), body=bodies, authorization=auth, rid=request_ids)
def test_random_json_bodies(corral: Corral, endpoint: str, body: dict[str, Any],
                            authorization: str, rid: str | None) -> None:
    raw = json.dumps(tame(body)).encode()
    check(seen(corral.http.post(endpoint, content=raw, headers=headers(authorization, rid))),
          rid)


@settings(FUZZ, max_examples=100)
@given(request=valid(), rid=request_ids)
def test_valid_bodies_are_served(corral: Corral, request: tuple[str, dict[str, Any]],
                                 rid: str | None) -> None:
    endpoint, body = request
    resp = seen(corral.http.post(endpoint, content=json.dumps(body).encode(),
                                 headers=headers(f"Bearer {KEY}", rid)))
    check(resp, rid)
    assert_served(endpoint, resp)


@settings(FUZZ, max_examples=1000)
@given(request=near_valid(), authorization=auth)
def test_nearly_valid_bodies(corral: Corral, request: tuple[str, dict[str, Any], bool],
                             authorization: str) -> None:
    endpoint, body, unchanged = request
    raw = json.dumps(tame(body)).encode()
    resp = seen(corral.http.post(endpoint, content=raw, headers=headers(authorization, None)))
    check(resp)
    if unchanged and authorization == f"Bearer {KEY}":
        assert_served(endpoint, resp)  # drawn valid and left so: served, not just "documented"


@settings(FUZZ, max_examples=400)
@given(endpoint=st.sampled_from(V1_POSTS),
       raw=st.sampled_from(RAW_SHAPES) | st.binary(max_size=300),
       content_type=st.sampled_from(CONTENT_TYPES),
       encoding=st.sampled_from(CONTENT_ENCODINGS))
def test_raw_bytes_and_content_types(corral: Corral, endpoint: str, raw: bytes,
                                     content_type: str, encoding: str | None) -> None:
    sent = headers(f"Bearer {KEY}", None, content_type)
    if encoding:
        sent["Content-Encoding"] = encoding  # a claim the bytes do not honour
    check(seen(corral.http.post(endpoint, content=raw, headers=sent)))


@settings(FUZZ, max_examples=250)
@given(name=st.sampled_from(HOSTILE_NAMES) | st.text(min_size=1, max_size=40),
       action=st.sampled_from(["load", "unload", "unload?force=true"]),
       encoded=st.booleans())
def test_admin_load_unload_with_hostile_names(corral: Corral, name: str, action: str,
                                              encoded: bool) -> None:
    segment = quote(name, safe="") if encoded else quote(name, safe="/.%?#")
    resp = corral.http.post(f"/admin/models/{segment}/{action}")
    # Unencoded, a '#' ends the path: "/admin/models/.#x/load" is a POST to /admin/models/.,
    # which the client normalises to /admin/models (GET only): 405 is the right answer there.
    check(seen(resp), also=frozenset() if encoded else frozenset({405}))
    if encoded:  # one path segment naming no model: nothing to load
        assert resp.status_code == 404, resp.text[:300]


SOURCES = st.sampled_from([
    "http://corral-fuzz.invalid/x.gguf",  # does not resolve: fails at once
    "owner/repo:file.gguf", "owner/repo@rev:dir/file.gguf", "owner/repo:../../etc/passwd",
    "http://127.0.0.1:9/%2e%2e%2fx.gguf", "file:///etc/passwd", "ftp://h/x.gguf", "http://",
    "javascript:alert(1)", "http://h/x.gguf?token=secret", "a" * 5000, "", " ", "🦙/🦙:🦙.gguf",
]) | st.text(max_size=60)
PULL_FIELDS = {
    "source": SOURCES | json_values,
    "name": st.sampled_from(["ok", "../x", ".hidden", "x.gguf", "a/b", "", "nul\x00",
                             "x" * 300]) | json_values,
    "sha256": st.sampled_from(["0" * 64, "Z" * 64, "0" * 63, ""]) | json_values,
    "force": st.booleans() | json_values,
}


@settings(FUZZ, max_examples=300)
@given(body=st.fixed_dictionaries({}, optional=PULL_FIELDS) | json_values)
def test_admin_pull_with_hostile_bodies(corral: Corral, body: Any) -> None:
    resp = seen(corral.http.post("/admin/pull", content=json.dumps(body).encode(),
                                 headers=JSON))
    check(resp, also=frozenset({202, 409}))
    if resp.status_code == 202:  # accepted: a real URL, checked names; it fails on its own
        assert resp.json()["file"].endswith(".gguf") and "/" not in resp.json()["file"]
        assert not resp.json()["file"].startswith(".")


@settings(FUZZ, max_examples=200)
@given(path=st.lists(st.sampled_from(["v1", "..", "%2e%2e", "models", "load", "", "a b",
                                      "chat", "completions", "admin", "%00", "🦙", "x" * 300])
                     | st.text(max_size=12), min_size=1, max_size=5),
       body=st.fixed_dictionaries({}, optional={"model": names | json_values}) | json_values)
def test_any_post_path_under_v1_and_the_router_api(corral: Corral, path: list[str],
                                                    body: Any) -> None:
    raw = json.dumps(body).encode()
    tail = "/".join(quote(p, safe="%") for p in path)
    for url in (f"/v1/{tail}", "/models/load", "/models/unload"):
        resp = seen(corral.http.post(url, content=raw, headers=JSON))
        check(resp, also=frozenset({405}))


@settings(FUZZ, max_examples=150)
@given(kinds=st.none() | st.text(max_size=40), since=st.none() | st.text(max_size=25),
       limit=st.none() | st.text(max_size=12), model=names)
def test_read_endpoints_with_hostile_queries(corral: Corral, kinds: str | None,
                                             since: str | None, limit: str | None,
                                             model: str) -> None:
    params = {k: v for k, v in (("kinds", kinds), ("since", since)) if v is not None}
    with corral.http.stream("GET", "/admin/events", params=params, timeout=5) as resp:
        if resp.status_code == 200:  # the stream is open: its headers are all there is yet
            assert resp.headers["content-type"].startswith("text/event-stream")
        else:
            resp.read()
        check(seen(resp))
    check(seen(corral.http.get("/admin/requests",
                               params={"limit": limit} if limit is not None else {})))
    check(seen(corral.http.get(f"/v1/models/{quote(model, safe='')}")))


def test_the_measured_shapes_and_the_daemon_after_all_that(corral: Corral) -> None:
    deep = corral.http.post("/v1/chat/completions", content=b"[" * 100_000,
                            headers={"Content-Type": "application/json"})
    check(deep)
    assert deep.status_code == 400
    chained = corral.http.post("/v1/chain/execute", json={"messages": ["x"], "group": "pipe"})
    check(chained)
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "messages[0]"

    assert httpx.get(corral.url + "/health").status_code == 200
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    batch = corral.http.post("/v1/batch/execute", json={"group": "pair", "messages": HI,
                                                        "max_tokens": 2})
    assert batch.status_code == 200 and batch.json()["complete"]
    assert not corral.log_events("proxy.unhandled")
    # The pulls the fuzzing started failed or were refused, each on its own: none is stuck.
    pulls = corral.http.get("/admin/pulls").json()["pulls"]
    assert all(p["state"] in ("failed", "running") for p in pulls), pulls

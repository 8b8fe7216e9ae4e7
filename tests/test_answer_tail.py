"""An answer's `usage` and `timings` read from its tail (proxy/answer_tail) are json.loads's,
or the tail is refused and the whole answer parsed: a `usage` anywhere but in the top-level
object never counts."""

from __future__ import annotations

import json
import random
from typing import Any

from corral.proxy.answer_tail import top_level_tail
from corral.proxy.timing import RequestRecord

LLAMA = {"choices": [{"finish_reason": "length", "index": 0,
                      "message": {"role": "assistant", "content": "Hello"}}],
         "created": 1700000000, "model": "tiny", "object": "chat.completion",
         "usage": {"completion_tokens": 1, "prompt_tokens": 9, "total_tokens": 10},
         "id": "chatcmpl-abc",
         "timings": {"cache_n": 3, "prompt_n": 6, "prompt_per_token_ms": 0.13,
                     "predicted_n": 1, "predicted_per_second": 2000.0}}


def _agrees(body: bytes) -> bool:
    """What the tail says agrees with the whole parse; whether the tail was read at all."""
    tail = top_level_tail(body)
    if tail is None:
        return False
    whole = json.loads(body)
    assert isinstance(whole, dict), body
    for key in ("usage", "timings"):
        assert tail.get(key) == whole.get(key), (key, body)
    return True


def test_llama_servers_answer_is_read_from_its_tail() -> None:
    for separators in ((",", ":"), (", ", ": ")):
        assert _agrees(json.dumps(LLAMA, separators=separators).encode())
    assert _agrees(json.dumps(LLAMA, indent=2).encode() + b"\n")
    record = RequestRecord("tiny", "/v1/chat/completions")
    record.read_usage(json.dumps(LLAMA).encode())
    assert (record.prompt_tokens, record.completion_tokens, record.cache_n) == (9, 1, 3)
    assert record.tokens_per_s == 2000.0 and record.prompt_ms_per_token == 0.13


def test_a_usage_anywhere_else_is_never_read_from_the_tail() -> None:
    fake = {"prompt_tokens": 999999, "completion_tokens": 999999}
    elsewhere = [
        # Nested in the last member, in a string, under an escaped quote, in a key.
        {**LLAMA, "extra": {"usage": fake}},
        {**LLAMA, "note": '{"usage": {"prompt_tokens": 999999}}'},
        {**LLAMA, "note": 'x", "usage": {"prompt_tokens": 999999}}'},
        {**LLAMA, 'a"usage': fake},
        # No usage at the top, only deeper; timings before usage.
        {"choices": [{"usage": fake}], "id": "x"},
        {"timings": LLAMA["timings"], "usage": LLAMA["usage"]},
    ]
    for data in elsewhere:
        body = json.dumps(data).encode()
        _agrees(body)  # read from the tail or refused, never another usage than the whole's
        record = RequestRecord("tiny", "/v1/chat/completions")
        record.read_usage(body)
        assert record.prompt_tokens != 999999
    # Not an object, not UTF-8, not JSON at the end: the whole parse decides.
    for body in (b'[{"usage": {}}]', b'{"usage": {"a": "\xff"}}', b'{"usage": {}} x',
                 b'{"usage": {}', b'{"usage" {}}', json.dumps(LLAMA).encode("utf-16")):
        assert top_level_tail(body) is None, body
    # A usage given twice at the top: the last, as json.loads.
    body = b'{"usage": {"prompt_tokens": 1}, "id": "x", "usage": {"prompt_tokens": 2}}'
    assert _agrees(body) and top_level_tail(body) == {"usage": {"prompt_tokens": 2}}


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return rng.choice([0, 7, -1.5, 1e300, True, None])
    if kind == 1:
        return rng.choice(['"usage"', 'a\\"usage":{', ',"usage":{"x":1}}', "é\n", ""])
    if kind == 2:
        return rng.randrange(1000)
    if kind == 3:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return _random_object(rng, depth + 1)


def _random_object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = ["usage", "timings", "id", "choices", 'x"usage', "usage "]
    return {rng.choice(keys): _random_value(rng, depth) for _ in range(rng.randrange(5))}


def test_random_answers_agree_with_the_whole_parse() -> None:
    rng = random.Random(37)
    read = 0
    for _ in range(3000):
        data = _random_object(rng, 0)
        if rng.random() < 0.5:
            data["usage"] = {"prompt_tokens": rng.randrange(100)}
        separators = rng.choice([(",", ":"), (", ", ": "), (" ,\n", " :\t")])
        body = json.dumps(data, separators=separators, ensure_ascii=rng.random() < 0.5)
        read += _agrees(body.encode())
    assert read > 500  # the tail was taken often, and never disagreed


def test_only_the_tail_of_an_answer_is_checked() -> None:
    # The one difference from the whole parse: an answer broken before its usage.
    body = b'{"choices": [oops], "usage": {"prompt_tokens": 5}}'
    assert top_level_tail(body) == {"usage": {"prompt_tokens": 5}}
    record = RequestRecord("tiny", "/v1/chat/completions")
    record.read_usage(body)
    assert record.prompt_tokens == 5

"""What the proxy sends a child for a request: pure functions, no processes."""

import json

from corral.proxy.routing import upstream_body


def test_canonical_name_passes_the_clients_bytes_through():
    raw = b'{"model": "smol",  "messages": [], "x": 1}'
    assert upstream_body(raw, json.loads(raw), "smol") is raw


def test_alias_is_replaced_by_the_model_name_and_nothing_else_changes():
    raw = b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 2}'
    sent = json.loads(upstream_body(raw, json.loads(raw), "smol"))
    assert sent == {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "n": 2}

"""What the edge (proxy/edge.py: Host, Origin, CORS) costs on every request, measured in one run,
beside the JSON parse of the smallest chat body, which every relayed request pays too.

    python bench/edge_check.py [--calls 200000]

The edge is on every request's path, before the keys: it must stay a small fraction of what a
request costs anyway (corral's whole CPU per relayed request is ~0.23 ms on the 2-core VM,
docs/performance.md)."""

from __future__ import annotations

import argparse
import json
import timeit

from aiohttp.test_utils import make_mocked_request

from corral.proxy.edge import Edge
from corral.supervisor.config import parse_config

BODY = b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    config = parse_config('allowed_origins: ["http://localhost:3000"]\nmodels: {}').config
    edge = Edge(lambda: config, "127.0.0.1")
    cases = {
        "SDK or curl (no Origin)": {"Host": "127.0.0.1:8080", "Content-Type": "application/json"},
        "corral's own page": {"Host": "localhost:8080", "Origin": "http://localhost:8080"},
        "an allowed web app": {"Host": "127.0.0.1:8080", "Origin": "http://localhost:3000"},
        "a foreign page (refused)": {"Host": "127.0.0.1:8080", "Origin": "http://evil.example"},
    }
    parse = timeit.timeit(lambda: json.loads(BODY), number=args.calls) / args.calls
    print(f"json.loads of the smallest chat body: {parse * 1e6:.2f} us (the reference)")
    for name, headers in cases.items():
        request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
        seconds = timeit.timeit(lambda r=request: edge.refusal(r),  # type: ignore[misc]
                                number=args.calls) / args.calls
        print(f"edge, {name}: {seconds * 1e6:.2f} us a request = {seconds / parse:.2f}x that "
              f"parse")


if __name__ == "__main__":
    main()

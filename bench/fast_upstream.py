"""An OpenAI-shaped server that answers at memory speed: the upstream for measuring what the
relay itself can carry (bench/relay_ceiling.py), with no model's pace in the way.

POST /v1/chat/completions: `stream: true` -> `max_tokens` SSE events in llama-server's shape
(one write each, the way a server writes tokens as they come), a usage event and
`data: [DONE]`; otherwise one small JSON answer with usage. GET /health -> 200.

    python bench/fast_upstream.py --port 8099
"""

from __future__ import annotations

import argparse
import json
import time

import uvloop
from aiohttp import web

CHUNK = ('{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"tok"}}],'
         '"created":%d,"id":"chatcmpl-fast","model":"fast","system_fingerprint":"b1",'
         '"object":"chat.completion.chunk"}')


PACE: web.AppKey[float] = web.AppKey("pace", float)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    tokens = int(body.get("max_tokens") or 16)
    created = int(time.time())
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    if not body.get("stream"):
        return web.json_response({
            "choices": [{"finish_reason": "length", "index": 0,
                         "message": {"role": "assistant", "content": "tok" * tokens}}],
            "created": created, "id": "chatcmpl-fast", "model": "fast",
            "object": "chat.completion", "usage": usage})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    event = b"data: " + (CHUNK % created).encode() + b"\n\n"
    pace = request.app[PACE]
    for _ in range(tokens):
        await response.write(event)  # waits only when the reader is behind (back-pressure)
        if pace:
            # A model's pace: the event is sent, then nothing for `pace` s. Blocking on
            # purpose (an asyncio timer is 1 ms coarse): one stream at a time when paced.
            time.sleep(pace)
    last = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
            "created": created, "id": "chatcmpl-fast", "model": "fast",
            "object": "chat.completion.chunk", "usage": usage}
    await response.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pace-us", type=int, default=0,
                        help="microseconds between a stream's events (one stream at a time)")
    args = parser.parse_args()
    app = web.Application()
    app[PACE] = args.pace_us / 1e6
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()

"""`corral run NAME [PROMPT]`: one streamed answer to PROMPT; without one, a chat that keeps
the conversation, a turn per line (typed at a `>>>` prompt on a terminal, or piped in), until
`/bye` or the end of input."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from corral.supervisor.ctl.client import Client
from corral.supervisor.ctl.exits import CtlError, Exit

BYE = "/bye"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a model, alias or group (`corral ps` lists models)")
    parser.add_argument("prompt", nargs="?",
                        help="ask this once; without it, chat a line at a time from stdin")
    parser.add_argument("--system", help="a system message that opens the conversation")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="stop each answer after N tokens")
    parser.add_argument("--verbose", action="store_true",
                        help="after each answer, print its token counts and speed to stderr")


def run(client: Client, args: argparse.Namespace, stdin: TextIO = sys.stdin,
        out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> Exit:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise CtlError("--max-tokens must be 1 or more", Exit.USAGE)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
        _answer(client, args, messages, out, err)
        return Exit.OK
    terminal = stdin.isatty()
    if terminal:
        import readline  # noqa: F401  (line editing and history for input())

        err.write(f"chatting with {args.name} at {client.url}; {BYE} or Ctrl-D ends\n")
    while True:
        line = _read(stdin, terminal)
        if line is None or line.strip() == BYE:
            return Exit.OK
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            messages.append({"role": "assistant",
                             "content": _answer(client, args, messages, out, err)})
        except CtlError as exc:
            if not terminal or exc.code in (Exit.UNREACHABLE, Exit.AUTH, Exit.NO_MODEL):
                raise
            # At a terminal a refused turn is said and dropped; the conversation goes on.
            err.write(f"error: {exc}\n")
            messages.pop()


def _read(stdin: TextIO, terminal: bool) -> str | None:
    if terminal:
        try:
            return input(">>> ")
        except EOFError:
            print()
            return None
    line = stdin.readline()
    return line.rstrip("\n") if line else None


def _answer(client: Client, args: argparse.Namespace, messages: list[dict[str, str]],
            out: TextIO, err: TextIO) -> str:
    """Stream one answer to `out` as it comes; the whole of it, for the history."""
    body: dict[str, Any] = {"model": args.name, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    began = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    for event in client.events("POST", "/v1/chat/completions", body, model=args.name):
        if isinstance(event.get("error"), dict):
            # A failure after the answer began: the status line is gone, the event says it.
            raise CtlError(f"{event['error'].get('message')} (mid-answer)")
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                first = first or time.monotonic()
                parts.append(text)
                out.write(text)
                out.flush()
    out.write("\n")
    out.flush()
    if args.verbose:
        err.write(_stats(usage, began, first) + "\n")
    return "".join(parts)


def _stats(usage: dict[str, Any] | None, began: float, first: float | None) -> str:
    """`prompt 23 tokens, answer 41 tokens in 1.9s (21.3 tokens/s), first token after 0.4s`."""
    took = time.monotonic() - began
    if not usage:
        return f"answer in {took:.1f}s (the model gave no token counts)"
    prompt, answer = usage.get("prompt_tokens"), usage.get("completion_tokens")
    line = f"prompt {prompt} tokens, answer {answer} tokens in {took:.1f}s"
    if first is not None and isinstance(answer, int) and answer > 1 and took > first - began:
        line += f" ({(answer - 1) / (took - (first - began)):.1f} tokens/s)"
    if first is not None:
        line += f", first token after {first - began:.1f}s"
    return line

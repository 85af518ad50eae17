"""Tool-call metrics over a logging window, under the names the trainer logs.

The executor returns results; whoever runs the turns (the rollout loop) records each assistant turn's
results here and takes a `summary()` once per logging window:

    tools/{name}/call_count, tools/{name}/failure_count   calls and failed calls per tool (sums)
    tools/{name}/latency_s, tools/latency_s               mean wall time per call, per tool and overall
    tools/unknown_name_count                              calls to a tool that does not exist (a policy error)
    tools/invalid_arguments_count, tools/error_count,
    tools/timeout_count                                   failed calls by status
    tools/parallel_calls_mean                             mean calls per assistant turn that called tools
    tools/failure_frequency                               failed calls / calls; NaN in a window with no call
    tools/hung_threads                                    sync calls that timed out and still hold a thread
    tools/parse_error_count                               tool calls the parser could not read (sum)
    tools/parse_error/{family}_count                      the same per parser family (qwen, llama, ...)
    tools/parse_error/{kind}_count                        the same per kind (bad_json, truncated, ...)

Parse errors come from the tool-call parser (`tools.parsers`), before any call runs; the rollout loop
records them with `record_parse_errors(parsed.errors)` for every reply.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tools.calls import ToolResult, ToolStatus
from tools.parsers.base import ParseError


@dataclass
class _PerTool:
    calls: int = 0
    failures: int = 0
    latency_s: float = 0.0


@dataclass
class ToolStats:
    """Accumulates tool-call results over one logging window. Not thread-safe: record from one event loop."""

    _per_tool: dict[str, _PerTool] = field(default_factory=lambda: defaultdict(_PerTool))
    _by_status: dict[ToolStatus, int] = field(default_factory=lambda: defaultdict(int))
    _calls: int = 0
    _failures: int = 0
    _latency_s: float = 0.0
    _turns_with_calls: int = 0
    _parse_errors_by_family: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _parse_errors_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, results: Sequence[ToolResult]) -> None:
        """Record the results of one assistant turn's tool calls."""
        if not results:
            return
        self._turns_with_calls += 1
        for result in results:
            self._calls += 1
            self._latency_s += result.latency_s
            self._by_status[result.status] += 1
            if not result.ok:
                self._failures += 1
            if result.status is ToolStatus.UNKNOWN_TOOL:
                continue  # no such tool: counted in unknown_name_count, not under a made-up name
            per_tool = self._per_tool[result.name]
            per_tool.calls += 1
            per_tool.failures += not result.ok
            per_tool.latency_s += result.latency_s

    def record_parse_errors(self, errors: Sequence[ParseError]) -> None:
        """Record the calls of one reply that the parser could not read (`ParsedMessage.errors`)."""
        for error in errors:
            self._parse_errors_by_family[error.family] += 1
            self._parse_errors_by_kind[str(error.kind)] += 1

    def summary(self, *, hung_threads: int | None = None) -> dict[str, float]:
        """The window's metrics (see the module docstring). Does not reset; call `reset()` for that."""
        out: dict[str, float] = {}
        for name, per_tool in sorted(self._per_tool.items()):
            out[f"tools/{name}/call_count"] = per_tool.calls
            out[f"tools/{name}/failure_count"] = per_tool.failures
            out[f"tools/{name}/latency_s"] = per_tool.latency_s / per_tool.calls
        out["tools/latency_s"] = self._latency_s / self._calls if self._calls else math.nan
        out["tools/unknown_name_count"] = self._by_status[ToolStatus.UNKNOWN_TOOL]
        out["tools/invalid_arguments_count"] = self._by_status[ToolStatus.INVALID_ARGUMENTS]
        out["tools/error_count"] = self._by_status[ToolStatus.ERROR]
        out["tools/timeout_count"] = self._by_status[ToolStatus.TIMEOUT]
        out["tools/parallel_calls_mean"] = (
            self._calls / self._turns_with_calls if self._turns_with_calls else math.nan
        )
        out["tools/failure_frequency"] = self._failures / self._calls if self._calls else math.nan
        out["tools/parse_error_count"] = sum(self._parse_errors_by_family.values())
        for family, count in sorted(self._parse_errors_by_family.items()):
            out[f"tools/parse_error/{family}_count"] = count
        for kind, count in sorted(self._parse_errors_by_kind.items()):
            out[f"tools/parse_error/{kind}_count"] = count
        if hung_threads is not None:
            out["tools/hung_threads"] = hung_threads
        return out

    def weights(self) -> dict[str, float]:
        """What each mean in `summary()` is a mean over (calls, or turns that called tools), so a caller that
        folds several windows together (`harness.metrics.MetricsWindow.add(name, value, weight)`) weights
        each by what it counted; names not listed are counts or gauges (weight 1)."""
        out: dict[str, float] = {
            f"tools/{name}/latency_s": per_tool.calls for name, per_tool in self._per_tool.items()
        }
        out["tools/latency_s"] = out["tools/failure_frequency"] = self._calls
        out["tools/parallel_calls_mean"] = self._turns_with_calls
        return out

    def __bool__(self) -> bool:
        """Whether anything was recorded since the last reset."""
        return bool(self._calls or self._parse_errors_by_family)

    def reset(self) -> None:
        """Start a new window."""
        self._per_tool.clear()
        self._by_status.clear()
        self._parse_errors_by_family.clear()
        self._parse_errors_by_kind.clear()
        self._calls = self._failures = self._turns_with_calls = 0
        self._latency_s = 0.0

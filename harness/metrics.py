"""Metrics over a logging window, reduced by the reference's rules.

Everything recorded since the previous log is reduced to one number per name, by the name:

    the last part contains the word "count"       summed           sample/dropped_stale_count
    the last part contains the word "max" / "min" largest/smallest completions/max_length, .../min
    the name ends in "_per_s" (a rate)            total / seconds  rollout/generated_tokens_per_s
    anything else                                 mean of what was recorded (per rollout, sample, call)

"Word" means a part between underscores, so `mean_terminated_length` is a mean, not a min. NaN values
are left out of means (a window without tool calls has no failure frequency); a mean with nothing left
is NaN. A window's state is plain data, so the rollout worker can send it to the trainer, which merges
it with its own before logging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def reduction(name: str) -> str:
    """How a metric is reduced over a window: "sum", "max", "min", "rate" or "mean"."""
    last = name.rsplit("/", 1)[-1]
    words = set(last.split("_"))
    if "count" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    if last.endswith("_per_s"):
        return "rate"
    return "mean"


@dataclass
class MetricsWindow:
    """Observations of one logging window; `summary()` reduces them (see the module docstring)."""

    # name -> [total, weight] for means and rates (weight = count, or seconds for a rate),
    # or the running sum / max / min for the other reductions
    _values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        """Record one observation (a per-rollout reward, a call's latency, a count to add, a max to keep)."""
        value = float(value)
        kind = reduction(name)
        if kind == "rate":
            raise ValueError(f"{name} is a rate: record it with add_rate(name, amount, seconds)")
        if kind == "mean" and math.isnan(value):
            self._values.setdefault(name, [0.0, 0.0])
            return
        slot = self._values.get(name)
        if slot is None:
            self._values[name] = [value * weight if kind == "mean" else value, weight]
        elif kind == "mean":
            slot[0] += value * weight
            slot[1] += weight
        elif kind == "sum":
            slot[0] += value
        elif kind == "max":
            slot[0] = max(slot[0], value)
        else:
            slot[0] = min(slot[0], value)

    def add_many(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.add(name, value)

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        """Record `amount` (tokens, calls) done in `seconds`; the window reports the total ratio."""
        slot = self._values.setdefault(name, [0.0, 0.0])
        slot[0] += amount
        slot[1] += seconds

    def merge(self, state: dict[str, list[float]]) -> None:
        """Fold in another window's `state()` (from another process)."""
        for name, (value, weight) in state.items():
            kind = reduction(name)
            slot = self._values.get(name)
            if slot is None:
                self._values[name] = [value, weight]
            elif kind in ("mean", "rate"):
                slot[0] += value
                slot[1] += weight
            elif kind == "sum":
                slot[0] += value
            elif kind == "max":
                slot[0] = max(slot[0], value)
            else:
                slot[0] = min(slot[0], value)

    def state(self) -> dict[str, list[float]]:
        """The window as plain, picklable data."""
        return {name: list(slot) for name, slot in self._values.items()}

    def summary(self) -> dict[str, float]:
        """One number per metric, reduced by its name's rule."""
        out = {}
        for name, (value, weight) in sorted(self._values.items()):
            if reduction(name) in ("mean", "rate"):
                out[name] = value / weight if weight else math.nan
            else:
                out[name] = value
        return out

    def reset(self) -> None:
        self._values.clear()

    def __bool__(self) -> bool:
        return bool(self._values)

"""Pacing the rollout worker: how many rollouts may run, and when a new group may start.

Three limits decide it (the reference's "Concurrency" section):

- Staleness, `TokenGate`: generation may hold up to `token_allowance` tokens queued or in flight, a figure
  the trainer sets to max(max_staleness, 1) times the tokens one step consumed (before the first step:
  full rows). Tokens are counted as packed, a group's prompt once (`GroupResult.num_tokens`); the trainer
  gives each sample's share back when it trains or drops it. A group starts only while the queue plus the
  estimated tokens of the groups in flight stay under it; until the first group finishes, there is no
  estimate, so one group runs at a time. Several worker processes share one gate (harness/rollout/sharing.py).
- Server load, `ConcurrencyCap`: a live cap on rollouts in flight that follows the server's /metrics. It
  starts at the requests that fit in the KV cache at full length (KV tokens / max_model_len), grows by
  25% while KV usage stays below 60% and nothing waits (at most once per cap's worth of finished
  rollouts), and shrinks by 30% when usage passes 80%. Without /metrics it is max_concurrent_rollouts.
- Resources: max_concurrent_rollouts, the ceiling of the cap.

`FailureBreaker` stops a run whose rollouts mostly fail for infrastructure reasons, instead of training on
what is left or spinning forever.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from harness.generation.server_load import ServerLoad


class TokenGate:
    """Whether a new group may start, given the token allowance (see the module docstring).

    The worker calls `try_start(allowance)` before a group (it counts the group as started when it says
    yes) and `group_finished(tokens)` once the group is queued; `produced` is what it queued in all.
    With `shared` (an int64 Array of SHARED_SLOTS, `multiprocessing.Array("q", SHARED_SLOTS)`) the counts
    are those of every worker process holding that array, read and changed under its lock: several
    processes keep one allowance exactly as one process would. `groups_in_flight` stays this process's.
    """

    SHARED_SLOTS = 4
    _IN_FLIGHT, _FINISHED_GROUPS, _FINISHED_TOKENS, _PRODUCED = range(SHARED_SLOTS)

    def __init__(self, shared: Any = None) -> None:
        self.groups_in_flight = 0
        self._counts: Any = shared if shared is not None else [0] * self.SHARED_SLOTS
        self._lock: Any = shared.get_lock() if shared is not None else contextlib.nullcontext()

    @property
    def produced(self) -> int:
        return int(self._counts[self._PRODUCED])

    @property
    def in_flight_everywhere(self) -> int:
        """Groups in flight in every process sharing the gate (this process's alone when not shared)."""
        return int(self._counts[self._IN_FLIGHT])

    def may_start(self, tokens_queued: int, allowance: int) -> bool:
        with self._lock:
            if self._counts[self._FINISHED_GROUPS] == 0:
                return self._counts[self._IN_FLIGHT] == 0  # no estimate yet: one group at a time
            return tokens_queued + self.in_flight_estimate() < max(allowance, 1)

    def try_start(self, allowance: int) -> bool:
        """Start a group if the allowance admits it (checked and counted as one step)."""
        with self._lock:
            if not self.may_start(self.produced, allowance):
                return False
            self.group_started()
            return True

    def in_flight_estimate(self) -> float:
        with self._lock:
            finished = self._counts[self._FINISHED_GROUPS]
            if finished == 0:
                return 0.0
            return self._counts[self._IN_FLIGHT] * self._counts[self._FINISHED_TOKENS] / finished

    def group_started(self) -> None:
        with self._lock:
            self.groups_in_flight += 1
            self._counts[self._IN_FLIGHT] += 1

    def group_finished(self, tokens: int) -> None:
        """A group was queued with `tokens` (0 when none of it trains: it still counts for the estimate)."""
        with self._lock:
            self.groups_in_flight -= 1
            self._counts[self._IN_FLIGHT] -= 1
            self._counts[self._FINISHED_GROUPS] += 1
            self._counts[self._FINISHED_TOKENS] += max(tokens, 1)
            self._counts[self._PRODUCED] += tokens


class ConcurrencyCap:
    """The live cap on rollouts in flight (see the module docstring)."""

    GROW, SHRINK = 1.25, 0.7
    LOW_USAGE, HIGH_USAGE = 0.6, 0.8

    def __init__(self, max_concurrent_rollouts: int, max_model_len: int, first_load: ServerLoad | None):
        self.ceiling = max_concurrent_rollouts
        self._finished_since_growth = 0
        if first_load is None or not first_load.kv_cache_tokens:
            self.value = max_concurrent_rollouts
            self.adaptive = first_load is not None and first_load.kv_cache_usage is not None
        else:
            self.value = max(
                1, min(max_concurrent_rollouts, first_load.kv_cache_tokens // max(max_model_len, 1))
            )
            self.adaptive = True

    def rollout_finished(self) -> None:
        self._finished_since_growth += 1

    def update(self, load: ServerLoad | None) -> None:
        """Adjust to a /metrics poll (every few seconds)."""
        if load is None or load.kv_cache_usage is None or not self.adaptive:
            return
        if load.kv_cache_usage > self.HIGH_USAGE:
            self.value = max(1, math.floor(self.value * self.SHRINK))
        elif (
            load.kv_cache_usage < self.LOW_USAGE
            and not load.num_waiting
            and self._finished_since_growth >= self.value
        ):
            self.value = min(self.ceiling, max(self.value + 1, math.floor(self.value * self.GROW)))
            self._finished_since_growth = 0


class RolloutFailureRate(RuntimeError):
    """Too many rollouts failed for infrastructure reasons; the message says which and why."""


@dataclass
class FailureBreaker:
    """Trips when more than `max_frac` of the last `window` rollouts failed."""

    window: int
    max_frac: float
    _recent: deque[tuple[bool, str]] = field(default_factory=deque)
    tripped: bool = False

    def record(self, failed: bool, error_type: str = "") -> None:
        """Count one finished rollout; raises RolloutFailureRate once, when the rate first passes."""
        if self.tripped:  # rollouts finishing while the run unwinds must not raise the same error again
            return
        self._recent.append((failed, error_type))
        if len(self._recent) > self.window:
            self._recent.popleft()
        if len(self._recent) == self.window:
            failures = [kind for is_failure, kind in self._recent if is_failure]
            if len(failures) / self.window > self.max_frac:
                by_type: dict[str, int] = {}
                for kind in failures:
                    by_type[kind] = by_type.get(kind, 0) + 1
                detail = ", ".join(f"{kind} x{count}" for kind, count in sorted(by_type.items()))
                self.tripped = True
                raise RolloutFailureRate(
                    f"{len(failures)} of the last {self.window} rollouts failed ({detail}); stopping instead "
                    "of training on what is left. Fix the cause (the errors above), or raise "
                    "max_failure_frac / failure_window in the config."
                )

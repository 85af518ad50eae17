"""Which prompts a run is done with: what epochs count and where a resumed run starts.

A prompt is done once its group is settled: it came with no sample to train (a dropped or filtered group),
or every one of its samples was trained on or dropped. A prompt whose samples were pulled from the worker
but not yet trained is not done, so a checkpoint written then makes the resumed worker generate it again
instead of losing it:

    ledger = PromptLedger(counters)            # restored from a checkpoint's counters, or fresh ones
    ledger.opened(position, num_samples=3)     # the trainer took a group's fresh samples
    ledger.settled(sample, trained=True)       # one of them was trained on (or dropped: trained=False)
    ledger.snapshot()                          # before a checkpoint: the counters say what is done

Groups finish out of order, so besides the first position not yet done (`counters.trained_position`) the
ledger keeps the done positions past it (`counters.done_positions`); the resumed worker skips those. A
prompt with some samples trained and some not at a checkpoint is generated again in full after the
resume: `counters.retrained_positions` lists those, the only prompts whose samples are trained twice.

Who talks to it: AsyncGRPOTrainer (harness/training/trainer.py), as it pulls and plans samples and before
it saves a checkpoint.
"""

from __future__ import annotations

from harness.training.checkpointing import RunCounters
from harness.types import TrainingSample


class PromptLedger:
    """The done prompts of a run, kept in its `RunCounters` (see the module docstring)."""

    def __init__(self, counters: RunCounters) -> None:
        self.counters = counters
        self._done_past_frontier = set(counters.done_positions)
        self._open: dict[int, list[int]] = {}  # position -> [samples not yet settled, samples trained]

    def opened(self, position: int, num_samples: int) -> None:
        """A group came in with `num_samples` samples to train (0: done at once)."""
        if num_samples:
            self._open[position] = [num_samples, 0]
        else:
            self._done(position)

    def settled(self, sample: TrainingSample, *, trained: bool) -> None:
        """One sample of an opened group was trained on, or dropped. A sample of no group (position -1:
        made by hand, as tests do) counts for nothing."""
        if sample.position < 0:
            return
        entry = self._open[sample.position]
        entry[0] -= 1
        entry[1] += int(trained)
        if entry[0] == 0:
            del self._open[sample.position]
            self._done(sample.position)

    def snapshot(self) -> None:
        """Write what is done, and what is partly trained, into the counters (before a checkpoint)."""
        self.counters.done_positions = sorted(self._done_past_frontier)
        self.counters.retrained_positions = sorted(p for p, (_, trained) in self._open.items() if trained)

    @property
    def num_open(self) -> int:
        """Prompts with samples not yet settled."""
        return len(self._open)

    def _done(self, position: int) -> None:
        counters = self.counters
        self._done_past_frontier.add(position)
        while counters.trained_position in self._done_past_frontier:
            self._done_past_frontier.discard(counters.trained_position)
            counters.trained_position += 1
        counters.prompts_done += 1


__all__ = ["PromptLedger"]

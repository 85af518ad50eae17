"""ServerStates: whether each generation server of a run is live or dropped, one record for every process.

Several routers talk to the same servers: the trainer's (rank 0's `ClientThread`, which drives the weight
syncs) and one in each rollout worker process (which samples). They must agree on which servers hold the
current policy, so they keep one record: a drop by any of them stops routing in all, and a server the
trainer takes back after a weight sync is routed to by all.

    states = ServerStates.shared(urls)             # the trainer, before it opens its router and the workers
    router = GenerationRouter.from_urls(urls, states=states)    # each process (the workers inherit it)
    seen = states.transitions()[index]             # what a caller saw before its call went out
    states.drop(index, seen)                       # True when this call dropped it (live before)
    states.readmit(index, seen)                    # True when this call took it back (dropped before)
    dropped, readmitted = states.pop_counts()      # since any holder's previous call: reported once

Each server's slot counts its *transitions*: 0 at the start of the run (live), one more at each drop and
each readmission, so an even count is live, an odd one dropped, and the drops and readmissions since the
start are read off it. A change is a compare-and-set on the count its caller saw, under one lock: two
routers dropping the same server at once make one drop, and a failure of a call sent before a
readmission cannot drop the server that came back since. Two more slots hold the drops and readmissions
already reported as metrics, so whichever router reports first reports each once (the processes' counts
then add up to the run's).

Shared: an int64 `multiprocessing.Array` of the spawn context with its lock, as harness/rollout/sharing.py
keeps the workers' counts; the trainer creates it and the rollout worker processes inherit it with their
channels (harness/rollout/worker.py). A router given none keeps a record of its own (`ServerStates(urls)`,
a plain list), as a router alone in its process needs nothing more.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Sequence
from typing import Any


def is_live(transitions: int) -> bool:
    """Whether a server whose slot counts `transitions` is live (see the module docstring)."""
    return transitions % 2 == 0


class ServerStates:
    """Live or dropped, per server of `urls`, for every router holding it (see the module docstring).

    `shared`: an int64 Array of `len(urls) + 2` slots with a lock (`ServerStates.shared` makes one); None:
    a plain list, for the routers of this process only.
    """

    def __init__(self, urls: Sequence[str], shared: Any = None) -> None:
        self.urls = tuple(urls)
        self._num_servers = len(self.urls)
        self._values: Any = shared if shared is not None else [0] * (self._num_servers + 2)
        self._lock: Any = shared.get_lock() if shared is not None else contextlib.nullcontext()

    @classmethod
    def shared(cls, urls: Sequence[str], context: Any = None) -> ServerStates:
        """In shared memory, for the trainer and the processes it spawns (`context`: default spawn)."""
        context = context or multiprocessing.get_context("spawn")
        return cls(urls, context.Array("q", len(urls) + 2))

    def transitions(self) -> list[int]:
        """Each server's count of transitions now (even: live)."""
        with self._lock:
            return [int(self._values[index]) for index in range(self._num_servers)]

    def is_live(self, index: int) -> bool:
        return is_live(int(self._values[index]))

    def drop(self, index: int, seen: int) -> bool:
        """Mark server `index` dropped if it is still as its caller saw it (`seen`, live); whether it did."""
        return self._advance(index, seen, from_live=True)

    def readmit(self, index: int, seen: int) -> bool:
        """Mark server `index` live if it is still as its caller saw it (`seen`, dropped); whether it did."""
        return self._advance(index, seen, from_live=False)

    def _advance(self, index: int, seen: int, *, from_live: bool) -> bool:
        with self._lock:
            if self._values[index] != seen or is_live(seen) != from_live:
                return False
            self._values[index] = seen + 1
            return True

    def pop_counts(self) -> tuple[int, int]:
        """(drops, readmissions) since the previous call by any holder of these states."""
        reported_drops, reported_readmissions = self._num_servers, self._num_servers + 1
        with self._lock:
            values = [int(self._values[index]) for index in range(self._num_servers)]
            drops = sum((value + 1) // 2 for value in values)
            readmissions = sum(value // 2 for value in values)
            counts = (
                drops - self._values[reported_drops],
                readmissions - self._values[reported_readmissions],
            )
            self._values[reported_drops], self._values[reported_readmissions] = drops, readmissions
        return int(counts[0]), int(counts[1])


__all__ = ["ServerStates", "is_live"]

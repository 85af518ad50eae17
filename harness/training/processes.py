"""The trainer's processes as one object: who is rank 0, how many there are, and the two collectives the
run itself needs (the model's collectives are FSDP2's, harness/training/fsdp.py).

    processes = Processes(rank=args.process_index, world_size=args.world_size)
    if processes.is_main: ...                      # rank 0 runs the worker and talks to the server
    plan = processes.broadcast(plan if processes.is_main else None)   # rank 0's value on every rank
    processes.barrier()                            # everyone here before anyone goes on

With one process both are no-ops, and torch.distributed is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Processes:
    """This process's rank among the trainer's `world_size` processes."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (any picklable object; the other ranks pass anything)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any process (every process calls it)."""
        if self.world_size == 1:
            return flag
        import torch.distributed as dist

        flags: list[Any] = [None] * self.world_size
        dist.all_gather_object(flags, bool(flag))
        return any(flags)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


__all__ = ["Processes"]

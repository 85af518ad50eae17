"""The trainer's processes as one object: who is rank 0, how many there are, and the two collectives the
run itself needs (the model's collectives are FSDP2's, harness/training/fsdp.py).

    processes = Processes(rank=args.process_index, world_size=args.world_size)
    if processes.is_main: ...                      # rank 0 runs the worker and talks to the server
    plan = processes.broadcast(plan if processes.is_main else None)   # rank 0's value on every rank
    processes.barrier()                            # everyone here before anyone goes on

With one process both are no-ops, and torch.distributed is never imported.

At the end of a run every rank calls `end_process_group()` (the trainer registers it to run at exit when
there are several processes; `python -m harness train` calls it too): see its docstring for why destroying
the group is not enough with gloo.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The name Linux shows for the worker threads of PyTorch's gloo process groups (/proc/self/task/*/comm).
GLOO_WORKER_THREAD = "pt_gloo_runloop"


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


def end_process_group(timeout_s: float = 10.0) -> None:
    """Destroy this process's torch.distributed groups, then wait until gloo's worker threads are idle, so
    that the interpreter can exit (nothing when torch was never imported or no group was formed).

    Destroying is not enough with gloo: a ProcessGroupGloo's worker threads live as long as the group object,
    which FSDP2's sharded modules still hold, and a worker lets go of a finished collective (its buffers,
    and through a barrier the collectives before it) a moment after the Python thread waiting for it has
    been released. If that moment falls after the interpreter has begun to finalize, freeing a buffer that
    had a Python object needs the GIL, Python ends the worker thread inside a C++ destructor, and the
    process aborts: "terminate called without an active exception", SIGABRT, after the run's work is done.
    Seen in CI and reproduced on a loaded 2-core machine (a core dump shows the worker in
    ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit). Run from an
    atexit hook or at the end of a rank, this wait lets the workers finish while the interpreter is whole.
    """
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if not wait_until_idle(GLOO_WORKER_THREAD, timeout_s):
        logger.warning(
            "gloo's worker threads were still busy %.0f s after the process group was destroyed; the "
            "interpreter may abort at exit ('terminate called without an active exception')",
            timeout_s,
        )


def wait_until_idle(thread_name: str, timeout_s: float) -> bool:
    """Wait until every thread of this process that Linux names `thread_name` sleeps and stays asleep,
    releasing the GIL meanwhile; whether they did within `timeout_s` (True off Linux: nothing to read).

    A thread counts as idle when it is sleeping (state S) and was not scheduled at all (its context
    switches unchanged) over a pause of several GIL switch intervals: a thread waiting for the GIL wakes
    once per interval, one waiting for work does not wake. Returns at once when there is no such thread.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return True
    pause = max(0.02, 4 * sys.getswitchinterval())
    deadline = time.monotonic() + timeout_s
    before = _thread_activity(tasks, thread_name)
    while before:
        time.sleep(pause)
        now = _thread_activity(tasks, thread_name)
        if all(activity[0] == "S" and before.get(tid) == activity for tid, activity in now.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        before = now
    return True


def count_threads(thread_name: str) -> int:
    """How many threads of this process Linux names `thread_name` (0 off Linux: nothing to read)."""
    tasks = Path("/proc/self/task")
    return len(_thread_activity(tasks, thread_name)) if tasks.is_dir() else 0


def _thread_activity(tasks: Path, thread_name: str) -> dict[str, tuple[str, int]]:
    """The state and context switches so far of each thread named `thread_name` (threads that end while
    being read are left out)."""
    activity = {}
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() != thread_name:
                continue
            state = (task / "stat").read_text().rsplit(") ", 1)[1].split()[0]
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        activity[task.name] = (state, switches)
    return activity


__all__ = ["GLOO_WORKER_THREAD", "Processes", "count_threads", "end_process_group", "wait_until_idle"]

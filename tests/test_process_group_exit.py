"""Ending a run's process group: `end_process_group` destroys it and waits until gloo's worker threads are
idle (harness/training/processes.py says why). The wait is checked on threads this test names as gloo
names its workers, and on a real gloo group in two processes."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.testing.ranks import run_ranks
from harness.training import processes
from harness.training.processes import GLOO_WORKER_THREAD, count_threads, end_process_group, wait_until_idle

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")

NAME = "test_worker"


def named_thread(name: str, body) -> threading.Thread:  # type: ignore[no-untyped-def]
    """A thread that gives itself `name` as Linux shows it (/proc/self/task/*/comm), then runs `body`."""

    def run() -> None:
        ctypes.CDLL(None).prctl(15, name.encode())  # PR_SET_NAME
        body()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_thread_is_idle_only_once_it_stops_waking():
    busy_until = time.monotonic() + 0.4
    stop = threading.Event()

    def works_then_waits() -> None:
        while time.monotonic() < busy_until:
            time.sleep(0.002)  # scheduled every few milliseconds, as a thread waiting for the GIL is
        stop.wait()  # asleep until told

    thread = named_thread(NAME, works_then_waits)
    time.sleep(0.05)
    assert wait_until_idle(NAME, timeout_s=10)
    assert time.monotonic() >= busy_until  # not while it still woke
    stop.set()
    thread.join()


def test_a_thread_that_keeps_waking_is_never_idle():
    stop = threading.Event()

    def keeps_waking() -> None:
        while not stop.is_set():
            time.sleep(0.002)

    thread = named_thread(NAME, keeps_waking)
    time.sleep(0.05)
    assert not wait_until_idle(NAME, timeout_s=0.3)
    stop.set()
    thread.join()


def test_threads_are_counted_by_the_name_linux_shows():
    stop = threading.Event()
    threads = [named_thread(NAME, stop.wait) for _ in range(2)]
    time.sleep(0.05)  # each names itself once started
    assert count_threads(NAME) == 2
    stop.set()
    for thread in threads:
        thread.join()
    assert count_threads(NAME) == 0


def test_no_such_thread_means_no_wait(monkeypatch):
    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"slept {seconds} s with no thread to wait for")

    monkeypatch.setattr(processes.time, "sleep", no_sleep)
    assert wait_until_idle("no_such_thread", timeout_s=10)


@pytest.mark.slow
def test_two_gloo_ranks_end_with_their_group_destroyed_and_its_workers_idle(tmp_path):
    # Each rank runs collectives (the last a barrier, as in the abort seen in CI), ends its group, and
    # reports what it sees afterwards.
    run_ranks([sys.executable, __file__], tmp_path, world_size=2, extra_args=[str(tmp_path)], timeout_s=120)
    for rank in range(2):
        seen = json.loads((tmp_path / f"seen{rank}.json").read_text())
        assert seen["workers"] >= 1, seen  # gloo's workers exist and carry the name the wait looks for
        assert seen["initialized"] is False and seen["idle"] is True, seen


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tensor = torch.full((1000,), float(rank))
    parts = [torch.empty(1000) for _ in range(world)]
    dist.all_gather(parts, tensor, async_op=True)
    del tensor, parts  # the collective alone holds its buffers now
    dist.barrier()
    workers = count_threads(GLOO_WORKER_THREAD)
    end_process_group()
    seen = {
        "workers": workers,
        "initialized": dist.is_initialized(),
        "idle": wait_until_idle(GLOO_WORKER_THREAD, timeout_s=0),
    }
    (Path(out_dir) / f"seen{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    rank, world, port, out_dir = sys.argv[1:5]
    _rank(int(rank), int(world), int(port), out_dir)

"""Several processes of one script as the ranks of a torch.distributed job, for tests and benchmarks on CPU.

    run_ranks([sys.executable, __file__], out_dir, world_size=2, timeout_s=300)
    # each rank runs `python script.py RANK WORLD PORT` plus the extra arguments; it joins a process group
    # itself (gloo on 127.0.0.1:PORT) and writes what it found under `out_dir`

Each rank's output goes to `out_dir/rank{N}.log`; the ranks see this checkout first on PYTHONPATH, one
thread each (OMP_NUM_THREADS=1), gloo on the loopback interface and Python's faulthandler. A rank still
running at the deadline is killed, as are the others once one fails; RuntimeError names the rank that failed
first, every rank's exit status and the failed rank's log tail.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from harness.testing.servers import free_port

REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    command: Sequence[str],
    out_dir: Path,
    *,
    world_size: int = 2,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> None:
    """Run `command RANK WORLD PORT *extra_args` for every rank and wait for all; raise if one fails."""
    port = free_port()
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = f"{REPO}{os.pathsep}{environment.get('PYTHONPATH', '')}"
    environment.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # PYTHONFAULTHANDLER: a rank that dies of a signal (an abort in a C++ library) prints its Python stacks
    environment.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    processes, logs = [], []
    try:
        for rank in range(world_size):
            log = open(out_dir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
            logs.append(log)
            argv = [*command, str(rank), str(world_size), str(port), *extra_args]
            processes.append(
                subprocess.Popen(argv, env=environment, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            )
        deadline = time.monotonic() + timeout_s
        while any(process.poll() is None for process in processes) and time.monotonic() < deadline:
            if any(process.poll() not in (None, 0) for process in processes):
                break  # the others would wait for it in a collective until their timeout
            time.sleep(0.1)
    finally:
        killed = [process.poll() is None for process in processes]
        for process, kill in zip(processes, killed, strict=True):
            if kill:
                process.kill()
            process.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    statuses = [
        f"killed: past {timeout_s:.0f} s, or another rank failed" if kill else f"exit {process.returncode}"
        for process, kill in zip(processes, killed, strict=True)
    ]
    # a rank that failed on its own first: the ones killed were waiting for it (or all ran out of time)
    for rank in sorted(range(len(processes)), key=lambda rank: killed[rank]):
        if processes[rank].returncode != 0:
            every = ", ".join(f"rank {other}: {status}" for other, status in enumerate(statuses))
            raise RuntimeError(f"rank {rank} failed ({every}); its output:\n{outputs[rank][-6000:]}")


__all__ = ["run_ranks"]

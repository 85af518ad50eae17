"""Processes a test's code started and left running: the built-in server, the rollout worker.

Read from /proc (Linux): the children of this process, their state and command line. Zombies (exited, not yet
reaped) and processes being torn down do not count.
"""

from __future__ import annotations

import os
from pathlib import Path


def live_children(*markers: str) -> list[str]:
    """The command lines of this process's running children that contain one of `markers`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited meanwhile
        state, parent = stat[stat.rfind(")") + 2 :].split()[:2]
        if int(parent) == os.getpid() and state not in "ZX" and any(m in cmdline for m in markers):
            found.append(cmdline)
    return found


def stray_sandbox_processes(wait_s: float = 3.0) -> list[str]:
    """Processes of local sandboxes that the reaper would kill (owner gone, or stranded out of their
    sandbox's tree), after waiting up to `wait_s` for ones being torn down; described, for a message."""
    import time

    from sandboxes.processes import state
    from sandboxes.reaper import stray_or_orphaned_executors

    deadline = time.monotonic() + wait_s
    while True:
        found = [p for p in stray_or_orphaned_executors() if (state(p.pid) or "Z") not in "ZX"]
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return [
        f"pid {p.pid} ({p.program}, parent {p.parent}, sandbox {p.sandbox}, owner {p.owner.pid})"
        for p in found
    ]

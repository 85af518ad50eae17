"""The host's process table, read from /proc (Linux), as the local backend and the reaper need it: parents,
states, and the processes that run a sandbox's executor.

A local sandbox's processes carry the executor's command line: the `bwrap` launcher, its namespace child
(the same command line until it execs, then the executor itself), and in Docker the executor inside the
container. The last argument is the executor's config, which names the sandbox and its owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sandboxes.owner import Owner


@dataclass(frozen=True)
class ExecutorProcess:
    pid: int
    parent: int
    program: str  # the basename of argv[0]: "bwrap" for the launcher and its child before it execs
    owner: Owner
    sandbox: str  # the sandbox's name


def parents() -> dict[int, int]:
    """pid -> parent pid of every process on the host."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat_fields(int(entry))
            if stat is not None:
                found[int(entry)] = int(stat[1])
    return found


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...), or None when there is no such process."""
    stat = _stat_fields(pid)
    return None if stat is None else stat[0]


def descendants(root: int, table: dict[int, int] | None = None) -> list[int]:
    """Every process below `root` (parents first)."""
    table = parents() if table is None else table
    found: list[int] = []
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in table.items() if parent in frontier and pid not in found}
        found += sorted(frontier)
    return found


def executor_processes() -> list[ExecutorProcess]:
    """Every process on the host whose command line runs our executor (`sandboxes/agent.py`, passed as
    source) with a config that names an owner."""
    from sandboxes.base import AGENT_SOURCE  # base reads agent.py at import; imported once used

    signature = AGENT_SOURCE[:80]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the command line ends with the source, the config and the empty string after the last NUL
        if len(argv) < 3 or not argv[-3].decode(errors="replace").startswith(signature):
            continue
        stat = _stat_fields(int(entry))
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            config = json.loads(argv[-2])
            owner = Owner.from_tag(config.get("owner") or "")
            if owner is not None and stat is not None:
                program = os.path.basename(argv[0].decode(errors="replace"))
                sandbox = str(config.get("sandbox"))
                found.append(ExecutorProcess(int(entry), int(stat[1]), program, owner, sandbox))
    return found


def stop_then_kill(find: Callable[[], Iterable[int]], *, rounds: int = 50, wait_s: float = 2.0) -> set[int]:
    """SIGSTOP what `find()` returns, waiting until each is really stopped (a signal is delivered
    asynchronously: a process still running can start a child after the look at /proc), until a look
    finds nothing new; then SIGKILL it all and wait until it is gone. Returns the pids killed."""
    stopped: set[int] = set()
    for _ in range(rounds):
        victims = set(find()) - stopped
        if not victims:
            break
        for victim in victims:
            _signal(victim, signal.SIGSTOP)
        _wait_until(victims, lambda pid: state(pid) in (None, "T", "t", "Z", "X"), wait_s)
        stopped |= victims
    victims = stopped | set(find())
    for victim in victims:
        _signal(victim, signal.SIGKILL)
    _wait_until(victims, lambda pid: state(pid) in (None, "Z", "X"), wait_s)
    return victims


def _wait_until(pids: set[int], done: Callable[[int], bool], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    remaining = set(pids)
    while True:
        remaining = {pid for pid in remaining if not done(pid)}
        if not remaining or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: state, parent pid, ... (or None)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].decode().split()

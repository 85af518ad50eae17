"""Who owns a sandbox: this host and process, recorded on every sandbox so a reaper can tell when the owner
is gone (a pid alone is not enough: pids are reused, so the process start time is recorded with it)."""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    start_ticks: int  # the process's start time, in clock ticks since boot (/proc/PID/stat field 22)

    def tag(self) -> str:
        """A file-name-safe form: host.pid.start_ticks."""
        return f"{self.host}.{self.pid}.{self.start_ticks}"

    @classmethod
    def from_tag(cls, tag: str) -> Owner | None:
        host_and_pid, _, ticks = tag.rpartition(".")  # from the right: host names may hold dots
        host, _, pid = host_and_pid.rpartition(".")
        try:
            return cls(host=host, pid=int(pid), start_ticks=int(ticks))
        except ValueError:
            return None

    def is_alive(self) -> bool:
        """Whether the owning process still runs (only answerable on its own host)."""
        return process_start_ticks(self.pid) == self.start_ticks


def process_start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot, or None when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # fields after the parenthesised command name start at field 3 (state); field 22 is starttime
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


@functools.cache
def _this_owner(pid: int) -> Owner:
    return Owner(
        host=socket.gethostname().replace("/", "_"), pid=pid, start_ticks=process_start_ticks(pid) or 0
    )


def this_owner() -> Owner:
    """The owner record of the calling process (recomputed after a fork)."""
    return _this_owner(os.getpid())


def owner_tag() -> str:
    return this_owner().tag()

"""Control groups for local sandboxes: memory, pids and CPU limits on a whole sandbox, where the harness
runs as root on a machine with cgroups (v2, or v1's memory, pids and cpu hierarchies).

    cgroup = SandboxCgroup.create("tag-abc123", limits)   # None where cgroups cannot be used here
    cgroup.add(pid)                                       # the process and what it starts from then on
    cgroup.remove()                                       # once its processes are gone (idempotent)
    cgroup_problem()                                      # why they cannot be used here, or None

Every sandbox's group lives under one parent named `agent-harness` (v2: /sys/fs/cgroup/agent-harness/<name>;
v1: /sys/fs/cgroup/{memory,pids,cpu}/agent-harness/<name>), named after its owner like the sandbox's
directory, so the reaper can remove what a killed run left. Memory is memory.max (v1: memory.limit_in_bytes
and, with swap accounting, memory.memsw.limit_in_bytes) with swap off, pids is pids.max, CPU is a quota of
`cpus` cores per 100 ms period. The pages of the sandbox's tmpfs mounts count in its memory.

Who talks to it: the local backend (local.py) creates one per sandbox once its executor answers, and removes
it when the sandbox closes; the reaper (reaper.py) removes groups of dead owners.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from sandboxes.base import Limits

ROOT = Path("/sys/fs/cgroup")
PARENT = "agent-harness"
CPU_PERIOD_US = 100_000
_V1_CONTROLLERS = ("memory", "pids", "cpu")


def cgroup_problem() -> str | None:
    """Why sandboxes cannot get cgroups on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "the harness does not run as root"
    if (ROOT / "cgroup.controllers").exists():
        available = set((ROOT / "cgroup.controllers").read_text().split())
        lacking = {"memory", "pids", "cpu"} - available
        return f"cgroups v2 lacks the {sorted(lacking)} controllers" if lacking else None
    missing = [name for name in _V1_CONTROLLERS if not (ROOT / name / "cgroup.procs").exists()]
    return f"no cgroup v2, and no cgroup v1 hierarchy for {missing}" if missing else None


class SandboxCgroup:
    """One sandbox's control group(s) (one directory under v2, one per controller under v1)."""

    def __init__(self, directories: list[Path]):
        self.directories = directories

    @classmethod
    def create(cls, name: str, limits: Limits) -> SandboxCgroup | None:
        """Create the sandbox's group with its limits; None where `cgroup_problem()` says why not."""
        if cgroup_problem() is not None:
            return None
        memory = limits.memory_mb << 20
        quota = max(int(limits.cpus * CPU_PERIOD_US), 1000)
        if (ROOT / "cgroup.controllers").exists():
            parent = ROOT / PARENT
            parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):  # enabled already, or by whoever made the parent
                (ROOT / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            directory = parent / name
            directory.mkdir()
            group = cls([directory])
            settings = {
                "memory.max": str(memory),
                "memory.swap.max": "0",
                "pids.max": str(limits.pids),
                "cpu.max": f"{quota} {CPU_PERIOD_US}",
            }
        else:
            group = cls([ROOT / controller / PARENT / name for controller in _V1_CONTROLLERS])
            for directory in group.directories:
                directory.mkdir(parents=True)
            memory_dir, pids_dir, cpu_dir = group.directories
            settings = {
                f"{memory_dir}/memory.limit_in_bytes": str(memory),
                f"{pids_dir}/pids.max": str(limits.pids),
                f"{cpu_dir}/cpu.cfs_period_us": str(CPU_PERIOD_US),
                f"{cpu_dir}/cpu.cfs_quota_us": str(quota),
            }
            if (memory_dir / "memory.memsw.limit_in_bytes").exists():  # swap accounting is on
                settings[f"{memory_dir}/memory.memsw.limit_in_bytes"] = str(memory)
        try:
            for path, value in settings.items():
                target = Path(path) if path.startswith("/") else group.directories[0] / path
                target.write_text(value)
        except OSError:
            group.remove()
            raise
        return group

    def add(self, pid: int) -> None:
        """Move a process into the group (its later children are born there)."""
        for directory in self.directories:
            (directory / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Delete the group; best effort (a group with live processes stays until the reaper runs)."""
        for directory in self.directories:
            with contextlib.suppress(OSError):
                directory.rmdir()


def orphaned_groups(is_dead: Callable[[str], bool]) -> list[Path]:
    """The sandbox groups under the parent(s) whose name `is_dead(name)` says belongs to a dead owner."""
    parents = [ROOT / PARENT] if (ROOT / "cgroup.controllers").exists() else []
    parents += [ROOT / controller / PARENT for controller in _V1_CONTROLLERS]
    found = []
    for parent in parents:
        if parent.is_dir():
            found += [path for path in sorted(parent.iterdir()) if path.is_dir() and is_dead(path.name)]
    return found


__all__ = ["SandboxCgroup", "cgroup_problem", "orphaned_groups"]

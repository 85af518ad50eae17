"""Removing what dead runs left behind: sandbox containers, local sandbox executors, directories and
control groups.

A sandbox is orphaned when the process that owns it is gone: it was killed with SIGKILL, or the machine
ran out of memory, so neither close() nor the exit hook ran. Every container carries labels naming its
owner (host, pid and the pid's start time, since pids are reused) and every local sandbox directory is
named after it, so the reaper can tell an orphan from a sandbox a live run still uses.

Rules: only containers with our `agent-harness.managed` label are ever touched. A container owned by
this host is removed when its owner process no longer exists; one owned by another host is left alone
(its owner cannot be checked from here) unless `other_hosts_older_than_s` says to remove old ones.

Local sandboxes are found three ways: the executor's command line carries its owner's tag (it is the
sandbox's pid 1, so killing it ends the sandbox's every process), its directory is named after the owner,
and so is its control group. Only processes whose command line is our executor's are ever killed: those
whose owner is gone, and a bwrap stranded outside its sandbox's tree (a namespace child whose launcher was
killed while setting it up waits forever, even while its owner lives).

Run it with `harness sandbox reap`; each backend also runs it once when a process starts its first
sandbox.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sandboxes import processes
from sandboxes.owner import Owner, this_owner
from sandboxes.processes import ExecutorProcess


def reap_containers(
    client: Any = None, *, dry_run: bool = False, other_hosts_older_than_s: float | None = None
) -> list[str]:
    """Remove orphaned sandbox containers; return the names of those removed (or that would be)."""
    from sandboxes.engine import LABELS, docker_client, remove_container

    client = client or docker_client()
    host = this_owner().host
    reaped = []
    for attrs in client.api.containers(all=True, filters={"label": f"{LABELS['managed']}=1"}):
        labels = attrs.get("Labels") or {}
        if labels.get(LABELS["managed"]) != "1":
            continue
        if not _orphaned(labels, host, other_hosts_older_than_s, LABELS):
            continue
        name = (attrs.get("Names") or [attrs["Id"][:12]])[0].lstrip("/")
        if not dry_run:
            remove_container(client, attrs["Id"])
        reaped.append(name)
    return reaped


def reap_local_dirs(
    root: Path | None = None, *, dry_run: bool = False, owner: Owner | None = None
) -> list[Path]:
    """Remove local sandbox directories whose owner process on this host is gone (only `owner`'s, if
    given)."""
    from sandboxes.local import remove_tree, sandbox_root

    root = root or sandbox_root()
    if not root.is_dir():
        return []
    host = this_owner().host
    reaped = []
    for path in sorted(root.iterdir()):
        found = Owner.from_tag(path.name.rsplit("-", 1)[0])
        if found is None or found.host != host or found.is_alive() or owner not in (None, found):
            continue
        if not dry_run:
            remove_tree(path)
        reaped.append(path)
    return reaped


def reap_local_executors(*, dry_run: bool = False, owner: Owner | None = None) -> list[int]:
    """SIGKILL the processes of local sandboxes whose owner on this host is gone, and strays: processes of
    a sandbox whose parent is neither the owner nor another process of that sandbox (a namespace child
    whose bwrap died while setting it up waits forever, whoever owns it); only `owner`'s, if given.
    Returns their pids."""
    reaped = []
    for process in stray_or_orphaned_executors():
        if owner not in (None, process.owner):
            continue
        if not dry_run:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
        reaped.append(process.pid)
    return reaped


def stray_or_orphaned_executors() -> list[ExecutorProcess]:
    """The executor processes on this host that the reaper kills (see reap_local_executors)."""
    found = processes.executor_processes()
    family = {(process.pid, process.owner, process.sandbox) for process in found}
    host = this_owner().host
    return [
        process
        for process in found
        if process.owner.host == host
        and (
            not process.owner.is_alive()
            or (
                process.parent != process.owner.pid
                and (process.parent, process.owner, process.sandbox) not in family
                and process.program == "bwrap"
            )
        )
    ]


def reap_local_cgroups(*, dry_run: bool = False) -> list[Path]:
    """Remove the (empty) control groups of local sandboxes whose owner on this host is gone."""
    from sandboxes.cgroups import orphaned_groups

    host = this_owner().host

    def dead(name: str) -> bool:
        owner = Owner.from_tag(name.rsplit("-", 1)[0])
        return owner is not None and owner.host == host and not owner.is_alive()

    groups = orphaned_groups(dead)
    if not dry_run:
        for group in groups:
            with contextlib.suppress(OSError):
                group.rmdir()
    return groups


def _orphaned(labels: dict[str, str], host: str, other_hosts_older_than_s: float | None, names: dict) -> bool:
    owner_host = labels.get(names["owner_host"])
    if owner_host == host:
        try:
            owner = Owner(host, int(labels[names["owner_pid"]]), int(labels[names["owner_start"]]))
        except (KeyError, ValueError):
            return False  # a label we cannot read: leave it for a person
        return not owner.is_alive()
    if other_hosts_older_than_s is None:
        return False
    try:
        created = datetime.fromisoformat(labels[names["created_at"]]).timestamp()
    except (KeyError, ValueError):
        return False
    return time.time() - created > other_hosts_older_than_s

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
and so is its control group. Only processes whose command line is our executor's are ever killed.

Run it with `harness sandbox reap`; each backend also runs it once when a process starts its first
sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sandboxes.owner import Owner, this_owner


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


def reap_local_dirs(root: Path | None = None, *, dry_run: bool = False) -> list[Path]:
    """Remove local sandbox directories whose owner process on this host is gone."""
    from sandboxes.local import remove_tree, sandbox_root

    root = root or sandbox_root()
    if not root.is_dir():
        return []
    host = this_owner().host
    reaped = []
    for path in sorted(root.iterdir()):
        owner = Owner.from_tag(path.name.rsplit("-", 1)[0])
        if owner is None or owner.host != host or owner.is_alive():
            continue
        if not dry_run:
            remove_tree(path)
        reaped.append(path)
    return reaped


def reap_local_executors(*, dry_run: bool = False) -> list[int]:
    """SIGKILL the executors of local sandboxes whose owner on this host is gone; return their pids."""
    host = this_owner().host
    reaped = []
    for pid, owner in _local_executors():
        if owner.host != host or owner.is_alive():
            continue
        if not dry_run:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        reaped.append(pid)
    return reaped


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


def _local_executors() -> list[tuple[int, Owner]]:
    """(pid, owner) of every process on this host running our executor (its config names the owner)."""
    from sandboxes.base import AGENT_SOURCE

    signature = AGENT_SOURCE[:80]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) < 3 or not argv[-3].decode(errors="replace").startswith(signature):
            continue
        with contextlib.suppress(ValueError, AttributeError):
            owner = Owner.from_tag(json.loads(argv[-2]).get("owner") or "")
            if owner is not None:
                found.append((int(entry), owner))
    return found


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

"""Which Docker engine a new sandbox goes to, and what this process knows of each engine it uses.

    await prepare(spec)            # a pool's start: every engine is probed, the image copied where missing
    slot = await reserve(spec)     # a place on the least-filled engine that answers (waits at the caps)
    ...                            # the backend creates the container on slot.engine.url
    slot.started()                 # it runs: no longer counted against engine_max_starting
    slot.release()                 # it is gone (idempotent)
    snapshot(spec.docker_engines)  # per engine: sandboxes, starting, lost, for metrics and logs

A spec's `docker_engines` name the engines (none: the one of DOCKER_HOST). Placement: among the engines that
answer and are under both caps (`engine_max_sandboxes`, `engine_max_starting`), the one with the fewest of
this process's sandboxes per CPU (the engine's NCPU, read by `prepare`), ties to the one with fewer
starting. While every engine that answers is at a cap, `reserve` waits for a slot to be freed; one that
waits past the spec's start_timeout_s with every engine full (engine_max_sandboxes) fails, naming the cap.

A lost engine is one that did not answer a call (refused, reset, timed out): the backend reports it with
`mark_lost`. It gets no new sandbox; the streams of the sandboxes on it end, so their rollouts fail as
SandboxDied (the backend's business), and their containers, which cannot be removed while it is away, are
kept in its `orphans`. Every RETRY_LOST_S it is probed again when a sandbox is placed (while every engine is
lost, at each placement); once it answers, it takes sandboxes again and its orphans are removed. `settle`
tries that once more when a pool closes, and names what is still left (the reaper removes such
containers once the run has ended).

The counts are process-wide, over every pool and loose sandbox, under one thread lock: exit hooks and
worker threads release slots too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from sandboxes import errors
from sandboxes.base import SandboxSpec
from sandboxes.engine import (
    docker_client,
    engine_call,
    engine_name,
    forget_client,
    remove_on,
    unreachable,
)

logger = logging.getLogger(__name__)

RETRY_LOST_S = 5.0
PROBE_TIMEOUT_S = 10
_RECHECK_S = 1.0  # a reservation waiting at the caps looks again this often, released slots or not


@dataclass(eq=False)
class Engine:
    """One engine as this process sees it."""

    url: str
    num_sandboxes: int = 0  # this process's sandboxes on it, those starting included
    num_starting: int = 0
    cpus: int = 1
    lost_reason: str | None = None
    retry_at: float = 0.0
    num_lost: int = 0  # times it was lost
    orphans: set[str] = field(default_factory=set)  # containers to remove once it answers again

    @property
    def name(self) -> str:
        return engine_name(self.url)

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None


class Slot:
    """A sandbox's place on one engine, from `reserve` until `release`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._starting = True
        self._held = True

    def started(self) -> None:
        with _lock:
            if self._starting:
                self._starting = False
                self.engine.num_starting -= 1
                _wake_waiting()

    def release(self) -> None:
        with _lock:
            if self._starting:
                self._starting = False
                self.engine.num_starting -= 1
            if self._held:
                self._held = False
                self.engine.num_sandboxes -= 1
                _wake_waiting()


def _wake_waiting() -> None:
    """Under _lock: a slot was freed; every waiting reservation looks again (from any thread)."""
    for loop, event in _waiting:
        with contextlib.suppress(RuntimeError):  # a loop already closed has no one waiting
            loop.call_soon_threadsafe(event.set)


_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # reservations waiting at the caps


def engine(url: str) -> Engine:
    """This process's record of the engine at `url` ("" for DOCKER_HOST's)."""
    with _lock:
        return _engine(url)


def _engine(url: str) -> Engine:
    found = _engines.get(url)
    if found is None:
        found = _engines[url] = Engine(url)
    return found


def urls_of(spec: SandboxSpec) -> tuple[str, ...]:
    return spec.docker_engines or ("",)


async def reserve(spec: SandboxSpec) -> Slot:
    """A slot on the engine a new sandbox of `spec` should go to (see the module docstring). Waits while
    every engine that answers is at a cap; past the spec's start_timeout_s at engine_max_sandboxes, that is
    an error (a wait for a starting slot is only a queue, and never one)."""
    urls = urls_of(spec)
    deadline = time.monotonic() + spec.start_timeout_s
    wakeup = (asyncio.get_running_loop(), asyncio.Event())
    while True:
        await _probe_lost(urls)
        with _lock:
            live = [_engine(url) for url in urls if not _engine(url).lost]
            below_cap = [
                candidate
                for candidate in live
                if spec.engine_max_sandboxes is None or candidate.num_sandboxes < spec.engine_max_sandboxes
            ]
            room = [candidate for candidate in below_cap if candidate.num_starting < spec.engine_max_starting]
            if room:
                chosen = min(room, key=lambda e: ((e.num_sandboxes + 1) / e.cpus, e.num_starting))
                chosen.num_sandboxes += 1
                chosen.num_starting += 1
                return Slot(chosen)
            if live:
                wakeup[1].clear()
                _waiting.append(wakeup)  # before the lock is let go, so no release is missed
        if not live:
            raise errors.EngineUnavailable(
                f"none of the {len(urls)} Docker engines answers ({_why_lost(urls)}); they are probed again "
                f"every {RETRY_LOST_S:.0f} s: start them, or name others in docker_engines"
            )
        if not below_cap and time.monotonic() > deadline:
            with _lock:
                _waiting.remove(wakeup)
            raise errors.SandboxStartError(
                f"every Docker engine that answers has engine_max_sandboxes={spec.engine_max_sandboxes} "
                f"sandboxes of this process, and none closed for {spec.start_timeout_s:.0f} s: raise the "
                "cap, add engines, or run fewer rollouts at once"
            )
        try:
            with anyio.move_on_after(_RECHECK_S):  # lost engines come due, the deadline passes
                await wakeup[1].wait()
        finally:
            with _lock:
                _waiting.remove(wakeup)


def mark_lost(url: str, reason: str) -> None:
    """An engine did not answer: no new sandbox goes there until it answers a probe again."""
    with _lock:
        lost = _engine(url)
        first = not lost.lost
        if first:
            lost.num_lost += 1
        lost.lost_reason = reason
        lost.retry_at = time.monotonic() + RETRY_LOST_S
    forget_client(url)
    if first:
        logger.warning(
            "Docker engine %s does not answer (%s): its sandboxes are lost, new ones go to the other "
            "engines; probing it again every %.0f s",
            lost.name,
            reason,
            RETRY_LOST_S,
        )


def add_orphan(url: str, container_id: str) -> None:
    """A container that could not be removed because its engine is lost: removed when it answers again."""
    with _lock:
        _engine(url).orphans.add(container_id)


async def prepare(spec: SandboxSpec) -> None:
    """Probe each engine of `spec` (its CPU count weighs placement) and make sure each that answers has the
    spec's image, copying it from an engine that has it (docker save | docker load). Raises
    EngineUnavailable when none answers, ImageNotFound when none has the image; an engine that does not
    answer is marked lost (and probed again later), not fatal while another does."""
    urls = urls_of(spec)
    has_image: dict[str, bool] = {}

    async def look(url: str) -> None:
        try:
            has_image[url] = await _probe_one(url, spec.image)
        except Exception as exc:
            if not unreachable(exc):
                raise

    async with anyio.create_task_group() as group:
        for url in urls:
            group.start_soon(look, url)
    if not has_image:
        raise errors.EngineUnavailable(f"no Docker engine answers: {_why_lost(urls)}")
    sources = [url for url, present in has_image.items() if present]
    missing = [url for url, present in has_image.items() if not present]
    if missing and not sources:
        raise errors.ImageNotFound(
            f"image {spec.image!r} is on none of the Docker engines ({', '.join(map(engine_name, urls))}): "
            f"build it on one with `harness sandbox build-image --tag {spec.image}` (DOCKER_HOST set to that "
            "engine); the others get it from there when a pool starts"
        )
    for url in missing:
        started = time.monotonic()
        await engine_call(_copy_image, spec.image, sources[0], url, engine=url)
        logger.info(
            "copied image %s from %s to %s in %.1f s",
            spec.image,
            engine_name(sources[0]),
            engine_name(url),
            time.monotonic() - started,
        )


async def settle(spec: SandboxSpec) -> None:
    """At a pool's close: remove the orphans of the spec's engines that answer again; log what is left."""
    for url in urls_of(spec):
        with _lock:
            pending = bool(_engine(url).orphans)
        if pending:
            with contextlib.suppress(Exception):
                await _probe_one(url)
        left = engine(url).orphans
        if left:
            logger.warning(
                "%d sandbox containers stay on Docker engine %s, which does not answer: once it is back and "
                "this run has ended, `harness sandbox reap --engine %s` removes them",
                len(left),
                engine(url).name,
                engine(url).name,
            )


def snapshot(urls: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Per engine (`urls`, or every engine this process has used): sandboxes, starting, lost, lost count."""
    with _lock:
        chosen = [_engine(url) for url in urls] if urls else list(_engines.values())
        return {
            item.name: {
                "sandboxes": item.num_sandboxes,
                "starting": item.num_starting,
                "lost": item.lost,
                "num_lost": item.num_lost,
                "orphans": len(item.orphans),
            }
            for item in chosen
        }


# --- internals ----------------------------------------------------------------------------------------


def _why_lost(urls: tuple[str, ...]) -> str:
    return "; ".join(f"{engine(url).name}: {engine(url).lost_reason}" for url in urls)


async def _probe_lost(urls: tuple[str, ...]) -> None:
    """Probe the lost engines among `urls` whose retry time has come (one prober each at a time); when all
    are lost, every one now: a run on one engine that was away for a moment must not wait RETRY_LOST_S."""
    now = time.monotonic()
    due = []
    with _lock:
        all_lost = all(_engine(url).lost for url in urls)
        for url in urls:
            candidate = _engine(url)
            if candidate.lost and (all_lost or candidate.retry_at <= now):
                candidate.retry_at = now + RETRY_LOST_S
                due.append(url)
    for url in due:
        with contextlib.suppress(Exception):
            await _probe_one(url)


async def _probe_one(url: str, image: str | None = None) -> bool:
    """Ask an engine (a lost one again); once it answers, it takes sandboxes and its orphans go. Returns
    whether it has `image` (True when None is asked)."""
    try:
        has_image = await engine_call(_probe, url, image, engine=url)
    except Exception as exc:
        if unreachable(exc):
            mark_lost(url, f"{type(exc).__name__}: {exc}")
        raise
    with _lock:
        back = _engine(url)
        was_lost, back.lost_reason = back.lost, None
        orphans, back.orphans = set(back.orphans), set()
    if was_lost:
        logger.warning("Docker engine %s answers again: it takes new sandboxes", back.name)
    left: set[str] = set()

    async def remove(container_id: str) -> None:
        try:
            await engine_call(remove_on, url, container_id, engine=url)
        except Exception:
            left.add(container_id)

    async with anyio.create_task_group() as group:
        for container_id in orphans:
            group.start_soon(remove, container_id)
    if left:
        with _lock:
            back.orphans |= left
    return has_image


def _probe(url: str, image: str | None) -> bool:
    """Blocking: ping the engine, record its CPU count; whether it has `image` (None: not asked)."""
    import docker

    client = docker_client(url, timeout_s=PROBE_TIMEOUT_S)
    cpus = int(client.info().get("NCPU") or 1)
    with _lock:
        _engine(url).cpus = max(cpus, 1)
    if image is None:
        return True
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def _copy_image(image: str, source_url: str, target_url: str) -> None:
    """Blocking: stream `image` out of one engine and into another, as `docker save | docker load` does."""
    source, target = docker_client(source_url), docker_client(target_url)
    for message in target.api.load_image(source.api.get_image(image)):
        if isinstance(message, dict) and message.get("error"):
            raise errors.ImageNotFound(
                f"loading image {image!r} into {engine_name(target_url)} failed: {message['error']}"
            )
    if not target.images.list(name=image):
        raise errors.ImageNotFound(f"image {image!r} did not arrive on {engine_name(target_url)}")


__all__ = [
    "RETRY_LOST_S",
    "Engine",
    "Slot",
    "add_orphan",
    "engine",
    "mark_lost",
    "prepare",
    "reserve",
    "settle",
    "snapshot",
    "urls_of",
]

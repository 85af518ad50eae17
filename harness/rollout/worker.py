"""The rollout worker process, and the trainer's handle on it.

    worker = RolloutWorker(loop_cls, loop_kwargs, heartbeat_timeout_s=config.rollout_worker_timeout)
    worker.start()                      # checks that every user callable pickles, then spawns
    result = worker.get(timeout_s=1.0)  # a GroupResult, or None; raises if the worker died or hung
    worker.check()                      # the same health check, for the trainer to call every step
    windows = worker.drain_metrics()    # metrics windows (MetricsWindow.state()) sent since last time
    worker.stop()                       # graceful (stop event), then SIGTERM, then SIGKILL

The worker is a *spawned* process (a fresh interpreter: CUDA state is never forked) with
CUDA_VISIBLE_DEVICES="" so it cannot touch the trainer's GPUs. It builds `loop_cls(**loop_kwargs, ...)`
there and runs `loop.run()`. Everything crossing the boundary is pickled, so reward functions, tools and
environment factories must be picklable: module-level functions, functools.partial or callable class
instances, not lambdas or closures; `start()` checks that first and names what is not.

Failure: an exception in the worker is sent to the trainer with its traceback and raised there as
`RolloutWorkerError`; a worker that exits, or whose heartbeat is older than `heartbeat_timeout_s`, is
reported the same way. Stopping closes the worker's environments and sandboxes (its loop unwinds on the
stop event or on SIGTERM); whatever a SIGKILL leaves, the sandbox reaper removes.

`num_processes=N` spawns N such processes behind the one handle: one queue of results, one allowance, the
prompts claimed from a shared cursor (harness/rollout/sharing.py); `finished` once all ran out of prompts,
`held` while all are held, and `check` names the process that failed. `server_states`, the run's record of
which generation servers are live (harness/generation/server_states.py, made by the trainer, whose router
holds it too), goes to every process with its channels, and from there to its loop's router.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.generation.server_states import ServerStates
from harness.rollout.sharing import WorkerShare, combine_windows
from harness.types import GroupResult
from sandboxes.owner import Owner, process_start_ticks, this_owner

log = logging.getLogger(__name__)

WORKER_PROCESS_NAME = "rollout-worker"
MAIN_GUARD_HINT = (
    "the worker is a spawned process that re-imports the training script, so the script must start "
    'training only under `if __name__ == "__main__":` (as the quick start does)'
)


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed, exited or hung; the message carries its traceback or what is known."""


def check_main_guard() -> None:
    """Refuse, before spawning, a training script that calls `.train(...)` at its top level outside an
    `if __name__ == "__main__":` block: the spawned worker would re-run it and fail (or hang) at start."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or not os.path.exists(path):
        return  # an interactive session, `python -c`, a notebook: nothing for spawn to re-import
    with contextlib.suppress(OSError, SyntaxError, ValueError):
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.If) and _is_main_test(node.test):
                continue
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            calls = [
                n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            ]
            if any(call.func.attr == "train" for call in calls):  # type: ignore[attr-defined]
                raise RuntimeError(f"{path}, line {node.lineno}, trains at import time: {MAIN_GUARD_HINT}")


def _is_main_test(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def refuse_in_worker_bootstrap() -> None:
    """Inside the spawned worker while it re-imports the training script: a trainer being built there means
    the script has no main guard; fail at once, before a model loads (the trainer then says why)."""
    if multiprocessing.current_process().name.startswith(WORKER_PROCESS_NAME):
        raise RuntimeError(f"a trainer was created inside the rollout worker: {MAIN_GUARD_HINT}")


@dataclass
class _Finished:
    """Sent by a worker process when its prompts are exhausted."""

    index: int = 0


@dataclass
class WorkerChannels:
    """The shared objects between trainer and worker (created by the trainer, inherited by the worker)."""

    rollout_buffer: Any
    model_version_value: Any
    token_allowance: Any
    heartbeat_value: Any
    failed_event: Any
    exception_info_queue: Any
    metrics_queue: Any
    stop_event: Any
    held_event: Any
    entered_event: Any  # set once worker_main runs: the child got past re-importing the training script
    share: WorkerShare | None = None  # with several worker processes: what they share, and which this is
    server_states: ServerStates | None = None  # which generation servers are live, shared with the trainer

    @classmethod
    def create(
        cls, context: Any, token_allowance: int, server_states: ServerStates | None = None
    ) -> WorkerChannels:
        return cls(
            rollout_buffer=context.Queue(),
            model_version_value=context.Value("q", 0),
            token_allowance=context.Value("q", token_allowance),
            heartbeat_value=context.Value("d", time.time()),
            failed_event=context.Event(),
            exception_info_queue=context.Queue(),
            metrics_queue=context.Queue(),
            stop_event=context.Event(),
            held_event=context.Event(),
            entered_event=context.Event(),
            server_states=server_states,
        )

    def for_process(self, context: Any, share: WorkerShare) -> WorkerChannels:
        """Another worker process's channels: the queue of results, the stop and failure events, the policy
        version, the allowance and the server states shared; its own metrics queue (the handle combines the
        processes' windows, harness/rollout/sharing.py) and heartbeat, held and entered flags."""
        return dataclasses.replace(
            self,
            metrics_queue=context.Queue(),
            heartbeat_value=context.Value("d", time.time()),
            held_event=context.Event(),
            entered_event=context.Event(),
            share=share,
        )


def worker_main(payload_path: str, channels: WorkerChannels, log_level: int | None = None) -> None:
    """The worker process's entry point (module level, so it pickles for spawn). `payload_path`: the
    pickled loop class and its arguments, which the worker deletes once read; `log_level`: the parent's,
    when it logs somewhere (spawn starts with logging unconfigured)."""
    channels.entered_event.set()
    with open(payload_path, "rb") as payload:
        loop_cls, loop_kwargs = pickle.load(payload)
    os.unlink(payload_path)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if log_level is not None:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
        )

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwind: environments, sandboxes and the client close

    signal.signal(signal.SIGTERM, terminate)
    _exit_with_parent()
    import anyio

    if channels.share is not None:
        loop_kwargs = {**loop_kwargs, "share": channels.share}
    if channels.server_states is not None:
        loop_kwargs = {**loop_kwargs, "server_states": channels.server_states}
    try:
        loop = loop_cls(
            **loop_kwargs,
            rollout_buffer=channels.rollout_buffer,
            model_version_value=channels.model_version_value,
            token_allowance=channels.token_allowance,
            heartbeat_value=channels.heartbeat_value,
            failed_event=channels.failed_event,
            exception_info_queue=channels.exception_info_queue,
            metrics_queue=channels.metrics_queue,
            stop_event=channels.stop_event,
            held_event=channels.held_event,
        )
        anyio.run(loop.run)
        channels.rollout_buffer.put(_Finished(channels.share.index if channels.share is not None else 0))
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and channels.stop_event.is_set()):
            channels.exception_info_queue.put(describe_failure(exc))
            channels.failed_event.set()
        raise


def _parent_log_level() -> int | None:
    """This process's logging level when its root logger has handlers (it logs somewhere), else None."""
    root = logging.getLogger()
    return root.getEffectiveLevel() if root.handlers else None


def describe_failure(exc: BaseException) -> str:
    """The root causes first (the leaves of an exception group, which a task group wraps them in), one
    line each, then the whole traceback: a log cut to its end still says why."""
    leaves, pending = [], [exc]
    while pending:
        current = pending.pop(0)
        if isinstance(current, BaseExceptionGroup):
            pending[:0] = list(current.exceptions)
        else:
            leaves.append(current)
    causes = "\n".join(f"  caused by {type(leaf).__name__}: {leaf}" for leaf in leaves[:5])
    return f"{causes}\n{''.join(traceback.format_exception(exc))}{causes}"


def _exit_with_parent() -> None:
    """SIGTERM ourselves when the trainer dies (even by SIGKILL), so no orphaned worker lingers."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class RolloutWorker:
    """The trainer's handle on the rollout process, or on `num_processes` of them sharing the prompts and the
    token allowance (harness/rollout/sharing.py); see the module docstring."""

    def __init__(
        self,
        loop_cls: type,
        loop_kwargs: Mapping[str, Any],
        *,
        heartbeat_timeout_s: float = 300.0,
        initial_token_allowance: int = 1 << 40,
        num_processes: int = 1,
        server_states: ServerStates | None = None,
    ):
        if num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {num_processes}")
        self.loop_cls = loop_cls
        self.loop_kwargs = dict(loop_kwargs)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.num_processes = num_processes
        self._context = multiprocessing.get_context("spawn")
        self.channels = WorkerChannels.create(self._context, initial_token_allowance, server_states)
        self._process_channels = [self.channels]  # one per process (the first is `channels`)
        if num_processes > 1:
            share = WorkerShare.create(
                self._context, num_processes, int(self.loop_kwargs.get("dataset_start_index", 0))
            )
            self._process_channels = [
                self.channels.for_process(self._context, share.for_process(index))
                for index in range(num_processes)
            ]
        self._processes: list[Any] = []
        self._payloads: list[Path] = []  # the loop's arguments, until each process has read them
        self._owners: list[Owner] = []  # each process as the owner its sandboxes name
        self._finished: set[int] = set()  # the processes whose prompts are exhausted

    @property
    def finished(self) -> bool:
        """Whether every worker process has run out of prompts."""
        return len(self._finished) == self.num_processes

    # --- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        check_main_guard()
        check_picklable(self.loop_cls, self.loop_kwargs)
        payload = pickle.dumps((self.loop_cls, self.loop_kwargs))  # once, however many processes read it
        for index, channels in enumerate(self._process_channels):
            self._start_process(index, channels, payload)

    def _start_process(self, index: int, channels: WorkerChannels, payload_bytes: bytes) -> None:
        # The loop's arguments (the dataset among them) go through a private file, so what spawn writes
        # into the child's pipe stays small: Process.start() writes it whole and, holding the pipe's read
        # end itself, blocks forever once it outgrows the pipe if the child died before reading it (a
        # training script without a main guard), instead of returning so `check` can say why.
        descriptor, path = tempfile.mkstemp(prefix="agent-harness-worker-", suffix=".pickle")
        self._payloads.append(Path(path))
        with os.fdopen(descriptor, "wb") as payload:
            payload.write(payload_bytes)
        process = self._context.Process(
            target=worker_main,
            args=(path, channels, _parent_log_level()),
            name=WORKER_PROCESS_NAME if self.num_processes == 1 else f"{WORKER_PROCESS_NAME}-{index}",
            daemon=True,
        )
        try:
            process.start()
        except (BrokenPipeError, EOFError) as exc:  # the child died while it re-imported the script
            Path(path).unlink(missing_ok=True)
            raise RolloutWorkerError(
                f"the rollout worker died while it started ({type(exc).__name__}); {MAIN_GUARD_HINT}"
            ) from exc
        self._processes.append(process)
        pid = process.pid
        assert pid is not None  # started
        self._owners.append(Owner(this_owner().host, pid, process_start_ticks(pid) or 0))

    def stop(self, graceful_s: float = 30.0) -> None:
        """Stop the worker processes: ask, then SIGTERM, then SIGKILL. Idempotent."""
        if not self._processes:
            return
        self.channels.stop_event.set()
        deadline = time.monotonic() + graceful_s
        while (alive := self._alive()) and time.monotonic() < deadline:
            # Keep reading while they wind down: a worker blocked writing into a full pipe cannot exit.
            _drain(self.channels.rollout_buffer)
            for channels in self._process_channels:
                _drain(channels.metrics_queue)
            alive[0].join(0.05)
        for process in self._alive():
            process.terminate()
        for process in self._alive():
            process.join(15.0)
        for process in self._alive():
            process.kill()
            process.join()
        self._processes = []
        for payload in self._payloads:
            payload.unlink(missing_ok=True)  # a worker that died before reading it
        self._reap_sandboxes()
        # Not read again: a process killed mid-write can leave half a message in the pipe.
        metrics_queues = [c.metrics_queue for c in self._process_channels if c is not self.channels]
        for channel in (
            self.channels.rollout_buffer,
            self.channels.exception_info_queue,
            self.channels.metrics_queue,
            *metrics_queues,
        ):
            channel.close()

    def _alive(self) -> list[Any]:
        return [process for process in self._processes if process.is_alive()]

    def _reap_sandboxes(self) -> None:
        """What of the workers' local sandboxes outlived them: a sandbox a worker was starting as it died can
        leave a bwrap namespace child that waits forever, and a SIGKILL skips its cleanup. The reaper finds
        them by their owner, the worker process, now gone."""
        from sandboxes.reaper import reap_local_dirs, reap_local_executors

        for owner in self._owners:
            killed = reap_local_executors(owner=owner)
            removed = reap_local_dirs(owner=owner)
            if killed or removed:
                log.warning(
                    "the rollout worker (pid %d) left %d sandbox processes and %d sandbox directories: "
                    "removed",
                    owner.pid,
                    len(killed),
                    len(removed),
                )

    def __enter__(self) -> RolloutWorker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- talking to it --------------------------------------------------------------------------------

    def get(self, timeout_s: float = 1.0) -> GroupResult | None:
        """The next group's result, or None after `timeout_s` (or when a process ran out of prompts: see
        `finished`); raises if a worker process failed or hung."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self.channels.rollout_buffer.get(
                    timeout=min(0.2, max(deadline - time.monotonic(), 0.01))
                )
            except queue.Empty:
                self.check()
                if time.monotonic() >= deadline:
                    return None
                continue
            if isinstance(item, _Finished):
                self._finished.add(item.index)
                return None
            return item

    def check(self) -> None:
        """Raise RolloutWorkerError if a worker process reported an error, exited, or stopped beating."""
        if self.channels.failed_event.is_set():
            try:
                detail = self.channels.exception_info_queue.get(timeout=5.0)
            except queue.Empty:
                detail = "(no traceback arrived)"
            raise RolloutWorkerError(f"the rollout worker failed:\n{detail}")
        for index, process in enumerate(self._processes):
            channels = self._process_channels[index]
            which = "" if self.num_processes == 1 else f" {index} of {self.num_processes} (pid {process.pid})"
            if not process.is_alive() and index not in self._finished:
                message = f"the rollout worker{which} exited unexpectedly (exit code {process.exitcode})"
                if not channels.entered_event.is_set():  # it died re-importing the training script
                    message += " while it started, before its entry point ran (its error is above): "
                    message += MAIN_GUARD_HINT
                raise RolloutWorkerError(message)
            age = time.time() - channels.heartbeat_value.value
            if index not in self._finished and age > self.heartbeat_timeout_s:
                raise RolloutWorkerError(
                    f"the rollout worker{which} sent no heartbeat for {age:.0f} s (rollout_worker_timeout "
                    f"is {self.heartbeat_timeout_s:g} s): it is hung"
                )

    def drain_metrics(self) -> list[dict[str, list[float]]]:
        """The metrics windows sent since the last call; with several processes, one window combining theirs
        (levels summed, what every process observes of the same servers taken once: combine_windows)."""
        per_process = []
        for channels in self._process_channels:
            windows = []
            with contextlib.suppress(queue.Empty):
                while True:
                    windows.append(channels.metrics_queue.get_nowait())
            per_process.append(windows)
        if self.num_processes == 1:
            return per_process[0]
        return [combine_windows(per_process)] if any(per_process) else []

    def set_model_version(self, version: int) -> None:
        self.channels.model_version_value.value = version

    def set_token_allowance(self, tokens: int) -> None:
        raised = tokens > self.channels.token_allowance.value
        self.channels.token_allowance.value = tokens
        if raised:  # `held` described the old allowance; each process sets it again if it still holds
            for channels in self._process_channels:
                channels.held_event.clear()

    @property
    def held(self) -> bool:
        """Whether generation waits for a higher token allowance with no group in flight (in every process
        that still has prompts): until the allowance is raised, nothing more reaches the queue."""
        return all(
            channels.held_event.is_set() or index in self._finished
            for index, channels in enumerate(self._process_channels)
        )


def check_picklable(loop_cls: type, loop_kwargs: Mapping[str, Any]) -> None:
    """Everything sent to the worker must pickle; raise TypeError naming the first thing that does not."""
    candidates: list[tuple[str, Any]] = [("loop_cls", loop_cls)]
    for func in loop_kwargs.get("reward_funcs") or []:
        candidates.append(("reward function", func))
    for tool in loop_kwargs.get("tools") or []:
        candidates.append(("tool", tool))
    factory = loop_kwargs.get("environment_factory")
    if isinstance(factory, Mapping):
        candidates += [(f"environment_factory[{name!r}]", value) for name, value in factory.items()]
    elif factory is not None:
        candidates.append(("environment_factory", factory))
    for key, value in loop_kwargs.items():
        if key not in ("reward_funcs", "tools", "environment_factory"):
            candidates.append((key, value))
    for what, value in candidates:
        try:
            pickle.dumps(value)
        except Exception as exc:
            name = getattr(value, "__qualname__", None) or type(value).__name__
            raise TypeError(
                f"the {what} {name} cannot be sent to the rollout worker process "
                f"({type(exc).__name__}: {exc}). Define it at module level, or use functools.partial or a "
                "callable class instance; lambdas and closures do not pickle. Keep the training code under "
                "`if __name__ == '__main__':`."
            ) from exc


def _drain(channel: Any) -> None:
    """Read and discard what a live worker has written so far."""
    with contextlib.suppress(queue.Empty, OSError, ValueError, EOFError):
        while True:
            channel.get(timeout=0.01)

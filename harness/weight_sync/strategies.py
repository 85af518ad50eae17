"""The weight-sync strategies: how the policy becomes servable as a new version after a step.

    sync = build_weight_sync(plan, ...)  # harness/weight_sync/plan.py chooses one at start
    sync.start(model, version)           # adapter sync: publishes the starting version
    metrics = sync.sync(model, version)  # each sync: {"perf/weight_sync_s": ..., ...}
    sync.close()                         # or: with build_weight_sync(...) as sync: ...

`server`: rank 0's `harness.generation.client_thread.ClientThread` (None on the other ranks). Each sync runs
inside its `readmitting()`: a generation server dropped earlier that answers /health again takes the sync
with the others (every merged weight, or the adapters), and only then is routed to again
(harness/generation/router.py, "Re-admission").

* `AdapterWeightSync` (a PEFT LoRA policy and a server that takes runtime adapters): each version's
  adapter is saved to `<output_dir>/.vllm_lora/<prefix>-v<version>/` (a temp dir, then a rename), loaded
  under that new name (never in place: vLLM keys its prefix cache on the name), and the version that falls
  out of the window of max_staleness + 1 loaded versions is unloaded; its files go one sync later (vLLM
  resolves the path lazily). The rollout worker names `adapter_name(prefix, version)` of the newest version
  it knows (harness/rollout/loop.py), so no new IPC is needed.
* `MergedWeightSync` with a transport (harness/weight_sync/transports.py: a shared-memory file, or a
  broadcast group). Every sync: /pause?mode=keep -> transfer -> /resume, resumed (and finished)
  best-effort after a failure too. LoRA is merged in one layer at a time and the parameters stream one at
  a time (`harness.weight_sync.peft.merged_named_parameters`): the whole model never exists twice. Under
  FSDP2 every process joins the gather, bucket by bucket (one collective per `gather_bucket_bytes` of
  weights, harness/weight_sync/gather.py), and rank 0, which alone receives the full tensors, sends.

Metrics: perf/weight_sync_s, split into perf/weight_sync_barrier_s (waiting for the other processes; only
with several), perf/weight_sync_pause_s (waiting for the server to pause; merged only) and
perf/weight_sync_transfer_s (sending the weights or the adapter); and for a broadcast to the built-in
server perf/weight_sync_sent_mb (what crossed: the whole weights, or with weight_sync_deltas their changed
elements, harness/weight_sync/deltas.py).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from harness.generation.protocol import ServerRequestError
from harness.weight_sync.gather import DEFAULT_GATHER_BUCKET_BYTES

if TYPE_CHECKING:
    import torch

    from harness.generation.client_thread import ClientThread
    from harness.weight_sync.transports import BroadcastTransfer, FileTransfer, IpcTransfer

log = logging.getLogger(__name__)

LORA_DIR = ".vllm_lora"


class WeightSyncError(RuntimeError):
    """A weight sync that cannot go on; the message says what to do."""


def adapter_name(prefix: str, version: int) -> str:
    """The served name of an adapter version (the trainer loads it, the rollout worker requests it)."""
    return f"{prefix}-v{int(version)}"


class WeightSync(abc.ABC):
    """One way of getting the policy to the server. `adapter_prefix`: the served names' prefix (adapters)."""

    kind = "base"
    adapter_prefix: str | None = None

    def __init__(self, server: ClientThread | None, *, is_main: bool = True, world_size: int = 1) -> None:
        self.server = server
        self.is_main = is_main
        self.world_size = world_size

    def start(self, model: Any, version: int) -> None:  # noqa: B027 -- optional hook, nothing by default
        """Before the first rollout: make `version` (the starting policy) servable."""

    def sync(self, model: Any, version: int) -> dict[str, float]:
        """Make the model servable as `version`, on the servers that answer again too; the
        perf/weight_sync_* timings."""
        started = time.monotonic()
        timings = {"perf/weight_sync_barrier_s": self._barrier()} if self.world_size > 1 else {}
        with self.server.readmitting() if self.server is not None else contextlib.nullcontext():
            timings.update(self._sync(model, version))
        timings["perf/weight_sync_s"] = time.monotonic() - started
        return timings

    @abc.abstractmethod
    def _sync(self, model: Any, version: int) -> dict[str, float]:
        """The strategy's own work: move the weights or the adapter; its timings."""

    def _barrier(self) -> float:
        import torch.distributed as dist

        started = time.monotonic()
        dist.barrier()
        return time.monotonic() - started

    def close(self) -> None:  # noqa: B027 -- optional hook, nothing by default
        """Release what the strategy holds (groups, adapters, files); best effort, idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MergedWeightSync(WeightSync):
    """Merged weights through a transport, between /pause?mode=keep and /resume (see the module docstring)."""

    def __init__(
        self,
        transfer: FileTransfer | IpcTransfer | BroadcastTransfer,
        server: ClientThread | None,
        *,
        gather_bucket_bytes: int = DEFAULT_GATHER_BUCKET_BYTES,
        send_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        """`gather_bucket_bytes`: under FSDP2, the bytes of weights gathered to rank 0 per collective; the
        default (256 MiB) is below the IPC and broadcast transports' own buffers (2 and 1 GiB).
        `send_dtype`: the server's dtype, when narrower than the policy's weights (a float32 policy, a bf16
        server): they are cast to it before they are gathered and sent, half the bytes, and what the server
        holds after its copy is the same (the cast rounds as the server's copy would). Every process must
        be given the same (the plan is broadcast)."""
        super().__init__(server, **kwargs)
        self.transfer = transfer
        self.kind = f"merged-{transfer.kind}"
        self.gather_bucket_bytes = gather_bucket_bytes
        self.send_dtype = send_dtype

    def _sync(self, model: Any, version: int) -> dict[str, float]:
        from harness.weight_sync.peft import merged_named_parameters

        weights = merged_named_parameters(
            model, bucket_size_bytes=self.gather_bucket_bytes, dtype=self.send_dtype
        )
        if not self.is_main:
            # FSDP2: every process joins each bucket's gather, in the same order; rank 0 receives and sends
            started = time.monotonic()
            _drain(weights)
            return {"perf/weight_sync_transfer_s": time.monotonic() - started}
        assert self.server is not None
        started = time.monotonic()
        self.server.call("pause", "keep")
        paused = time.monotonic()
        try:
            self.transfer.send(self.server, model, weights, self.send_dtype)
        except BaseException as exc:
            if not getattr(self.transfer, "keeps_weights_on_failure", True):
                # vLLM swapped its weights out at /start_weight_update: resuming would run requests on
                # them and kill its engine; it stays paused, and the run stops with the fix
                raise WeightSyncError(
                    f"the weight update to vLLM failed midway ({type(exc).__name__}: {exc}); its weights are "
                    "now in an unknown state, so the server was left paused: restart vLLM, then resume the "
                    "run from its last checkpoint"
                ) from exc
            with contextlib.suppress(Exception):
                self.server.call("finish_weight_update")
            with contextlib.suppress(Exception):
                self.server.call("resume")
            raise
        sent = time.monotonic()
        self.server.call("resume")
        metrics = {"perf/weight_sync_pause_s": paused - started, "perf/weight_sync_transfer_s": sent - paused}
        sent_bytes = getattr(self.transfer, "last_sent_bytes", None)
        if sent_bytes is not None:  # a broadcast to the built-in server: whole, or deltas (deltas.py)
            metrics["perf/weight_sync_sent_mb"] = sent_bytes / 2**20
        return metrics

    def close(self) -> None:
        self.transfer.close()


class AdapterWeightSync(WeightSync):
    """LoRA adapter sync: versioned adapter directories loaded under versioned names (module docstring)."""

    kind = "adapter"

    def __init__(
        self,
        server: ClientThread | None,
        output_dir: str | Path,
        *,
        window: int,
        prefix: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(server, **kwargs)
        self.root = Path(output_dir) / LORA_DIR
        self.window = max(int(window), 1)
        self.adapter_prefix = prefix or f"policy-{uuid.uuid4().hex[:8]}"
        self.loaded: collections.deque[tuple[str, Path]] = collections.deque()
        self.to_delete: list[Path] = []

    def start(self, model: Any, version: int) -> None:
        self.sync(model, version)

    def _sync(self, model: Any, version: int) -> dict[str, float]:
        started = time.monotonic()
        state = _adapter_state_dict(model)  # every process: FSDP2 gathers each adapter tensor
        if self.is_main:
            self._publish(model, state, version)
        return {"perf/weight_sync_transfer_s": time.monotonic() - started}

    def _publish(self, model: Any, state: dict[str, Any], version: int) -> None:
        assert self.server is not None
        for directory in self.to_delete:  # fell out of the window one sync ago
            shutil.rmtree(directory, ignore_errors=True)
        self.to_delete = []
        assert self.adapter_prefix is not None  # set in __init__
        name = adapter_name(self.adapter_prefix, version)
        directory = self.root / name
        self.root.mkdir(parents=True, exist_ok=True)
        temp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            model.save_pretrained(str(temp), state_dict=state, save_embedding_layers=False)
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(temp, directory)
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        try:
            self.server.call("load_lora_adapter", name, str(directory))
        except ServerRequestError as exc:
            if exc.status == 404:
                raise WeightSyncError(
                    "the server refused to load a LoRA adapter at run time (404 on /v1/load_lora_adapter): "
                    "start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (with --api-server-count 1: vLLM "
                    "refuses runtime adapters with several API servers)"
                ) from exc
            raise
        self.loaded.append((name, directory))
        while len(self.loaded) > self.window:
            old_name, old_directory = self.loaded.popleft()
            try:
                self.server.call("unload_lora_adapter", old_name)
            except Exception as exc:  # a leftover adapter must not stop training
                log.warning("could not unload adapter %s: %s", old_name, exc)
            self.to_delete.append(old_directory)

    def close(self) -> None:
        if self.is_main and self.server is not None:
            while self.loaded:
                name, directory = self.loaded.popleft()
                with contextlib.suppress(Exception):
                    self.server.call("unload_lora_adapter", name)
                self.to_delete.append(directory)
        for directory in self.to_delete:
            shutil.rmtree(directory, ignore_errors=True)
        self.to_delete = []


def _adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The LoRA tensors under the model's state-dict names, full (FSDP2: gathered), on the CPU."""
    state = {}
    for name, parameter in model.named_parameters():
        if ".lora_" in name:
            tensor = parameter.detach()
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            state[name] = tensor.to("cpu", copy=True)
    return state


def _drain(weights: Iterator[Any]) -> None:
    for _ in weights:
        pass


__all__ = [
    "LORA_DIR",
    "AdapterWeightSync",
    "MergedWeightSync",
    "WeightSync",
    "WeightSyncError",
    "adapter_name",
]

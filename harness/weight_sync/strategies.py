"""How the policy reaches the generation server at each weight sync (one strategy, chosen at start).

    plan = plan_weight_sync(model, client.server_info(), base_url=..., max_staleness=...)   # rank 0
    sync = build_weight_sync(plan, model=..., server=client, ...)                           # every rank
    sync.start(model, version)           # adapter sync: publishes the starting version
    metrics = sync.sync(model, version)  # each sync: {"perf/weight_sync_s": ..., ...}
    sync.close()                         # or: with build_weight_sync(...) as sync: ...

`client`/`server`: rank 0's `harness.generation.client_thread.ClientThread` (None on the other ranks).

Strategies (`WeightSync`: `start`, `sync`, `close`, `adapter_prefix`):

* `AdapterWeightSync` (a PEFT LoRA policy and a server that takes runtime adapters): each version's
  adapter is saved to `<output_dir>/.vllm_lora/<prefix>-v<version>/` (a temp dir, then a rename), loaded
  under that new name (never in place: vLLM keys its prefix cache on the name), and the version that falls
  out of the window of max_staleness + 1 loaded versions is unloaded; its files go one sync later (vLLM
  resolves the path lazily). The rollout worker names `adapter_name(prefix, version)` of the newest version
  it knows (harness/rollout/loop.py), so no new IPC is needed.
* `MergedWeightSync` with `FileTransfer` (the built-in server on this host) or `BroadcastTransfer` (a
  torch.distributed group the built-in server joins: NCCL on GPU, gloo on CPU; a vLLM server joins
  `harness.weight_sync.vllm_nccl.VllmNcclGroup`, vLLM's stateless group with pynccl). Every sync:
  /pause?mode=keep
  -> transfer -> /resume, resumed (and finished) best-effort after a failure too. LoRA is merged in one
  layer at a time and the parameters stream one at a time (`harness.weight_sync.peft.merged_named_parameters`;
  under FSDP2 each is all-gathered by every process in the same order, rank 0 sends): the whole model
  never exists twice.

Choice (`plan_weight_sync`): adapter sync when the policy is a PEFT LoRA model and the server reports
LoRA support (server_info lora_config with max_loras >= max_staleness + 2 and the adapter's rank within
max_lora_rank, one data-parallel engine), else merged, with one log line saying why; merged goes through
the file for the built-in server on this host, else through the broadcast.

Metrics: perf/weight_sync_s, split into perf/weight_sync_barrier_s (waiting for the other processes; only
with several), perf/weight_sync_pause_s (waiting for the server to pause; merged only) and
perf/weight_sync_transfer_s (sending the weights or the adapter).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import functools
import ipaddress
import logging
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch

    from harness.generation.client_thread import ClientThread
    from harness.weight_sync.vllm_nccl import WeightTransferServer
    from harness.weight_sync.wire import BroadcastGroup

log = logging.getLogger(__name__)

LORA_DIR = ".vllm_lora"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_name(prefix: str, version: int) -> str:
    """The served name of an adapter version (the trainer loads it, the rollout worker requests it)."""
    return f"{prefix}-v{int(version)}"


# --- the choice ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightSyncPlan:
    """What `plan_weight_sync` chose: "adapter", "file" or "broadcast", and why (for the log)."""

    kind: str
    reason: str
    adapter_rank: int | None = None


def check_no_lm_head_adapter(peft_config: Any) -> None:
    """Refuse an adapter that trains lm_head (target_modules or modules_to_save): raise ValueError."""
    targets = getattr(peft_config, "target_modules", None)
    names = [targets] if isinstance(targets, str) else list(targets or [])
    modules = list(getattr(peft_config, "modules_to_save", None) or [])
    if any("lm_head" in str(name) for name in [*names, *modules]):
        raise ValueError(
            "PEFT adapters on lm_head are not supported: the trainer's log-prob head reads the base output "
            "embedding directly (an adapter there would not be trained or synced), and neither vLLM nor "
            "the built-in server serves LoRA on lm_head at run time. Remove lm_head from target_modules "
            "and modules_to_save (target_modules='all-linear' already leaves it out)."
        )


def lora_config_of(model: Any) -> Any | None:
    """The active LoRA config of a PEFT LoRA model; None for any other model."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else next(iter(configs.values()))
    if config is None or str(getattr(config, "peft_type", "")).split(".")[-1].upper() != "LORA":
        return None
    return config


def lora_rank(config: Any) -> int:
    return max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])


def plan_weight_sync(
    model: Any,
    server_info: dict[str, Any],
    *,
    base_url: str,
    max_staleness: int,
) -> WeightSyncPlan:
    """Choose how the policy reaches the server (see the module docstring) and log it; rank 0 only."""
    plan = _plan(model, server_info, base_url=base_url, max_staleness=max_staleness)
    log.info("weight sync: %s (%s)", plan.kind, plan.reason)
    return plan


def _plan(model: Any, server_info: dict[str, Any], *, base_url: str, max_staleness: int) -> WeightSyncPlan:
    builtin = str(server_info.get("server", "")).startswith("agent-harness")
    merged = "file" if builtin and is_local_url(base_url) else "broadcast"
    config = lora_config_of(model)
    if config is None:
        return WeightSyncPlan(merged, "the policy is not a PEFT LoRA model")
    rank = lora_rank(config)
    vllm_config = server_info.get("vllm_config") or {}
    lora = vllm_config.get("lora_config")
    data_parallel = int((vllm_config.get("parallel_config") or {}).get("data_parallel_size") or 1)
    needed = max_staleness + 2
    problem = None
    if not lora:
        problem = (
            "the server has no LoRA support (server_info lora_config is null, or no /server_info: vLLM "
            "needs VLLM_SERVER_DEV_MODE=1); for adapter sync start it with --enable-lora "
            f"--max-lora-rank {_lora_rank_flag(rank)} --max-loras {needed} (vLLM: and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
        )
    elif data_parallel > 1:
        problem = f"data-parallel servers (data_parallel_size={data_parallel}) cannot take runtime adapters"
    elif getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
        problem = "the adapter uses DoRA or modules_to_save, which runtime adapter loading does not serve"
    elif int(lora.get("max_loras") or 0) < needed:
        problem = (
            f"the server's max_loras={lora.get('max_loras')} is below max_staleness + 2 = {needed}; "
            f"restart it with --max-loras {needed}"
        )
    elif int(lora.get("max_lora_rank") or 0) < rank:
        problem = (
            f"the adapter's rank {rank} is over the server's max_lora_rank={lora.get('max_lora_rank')}; "
            f"restart it with --max-lora-rank {_lora_rank_flag(rank)}"
        )
    if problem is not None:
        return WeightSyncPlan(merged, f"merged sync instead of adapter sync: {problem}")
    return WeightSyncPlan("adapter", f"the server serves LoRA adapters (rank {rank} adapter)", rank)


def _lora_rank_flag(rank: int) -> int:
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def is_local_url(url: str) -> bool:
    """Whether the URL's host is this machine (loopback, or this host's own name)."""
    host = urlparse(url if "//" in url else f"http://{url}").hostname or ""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host in ("localhost", socket.gethostname()) or host == socket.getfqdn()


def build_weight_sync(
    plan: WeightSyncPlan,
    *,
    server: ClientThread | None,
    is_main: bool,
    world_size: int,
    output_dir: str | Path,
    max_staleness: int,
    device: torch.device | str = "cpu",
    base_url: str = "",
) -> WeightSync:
    """The strategy of `plan`, on every process (rank 0 talks to the server through `server`)."""
    if plan.kind == "adapter":
        return AdapterWeightSync(
            server, output_dir, window=max_staleness + 1, is_main=is_main, world_size=world_size
        )
    if plan.kind == "file":
        return MergedWeightSync(FileTransfer(), server, is_main=is_main, world_size=world_size)
    if plan.kind == "broadcast":
        transfer = BroadcastTransfer(device=device)
        if is_main:
            transfer.connect(server, base_url)
        return MergedWeightSync(transfer, server, is_main=is_main, world_size=world_size)
    raise ValueError(f"unknown weight sync kind {plan.kind!r}")


# --- strategies ------------------------------------------------------------------------------------------


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
        """Make the model servable as `version`; the perf/weight_sync_* timings."""
        started = time.monotonic()
        timings = {"perf/weight_sync_barrier_s": self._barrier()} if self.world_size > 1 else {}
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
        self, transfer: FileTransfer | BroadcastTransfer, server: ClientThread | None, **kwargs: Any
    ) -> None:
        super().__init__(server, **kwargs)
        self.transfer = transfer
        self.kind = f"merged-{transfer.kind}"

    def _sync(self, model: Any, version: int) -> dict[str, float]:
        from harness.weight_sync.peft import merged_named_parameters

        weights = merged_named_parameters(model)
        if not self.is_main:
            # FSDP2: every process joins each parameter's all-gather, in the same order; rank 0 sends
            started = time.monotonic()
            _drain(weights)
            return {"perf/weight_sync_transfer_s": time.monotonic() - started}
        assert self.server is not None
        started = time.monotonic()
        self.server.call("pause", "keep")
        paused = time.monotonic()
        try:
            self.transfer.send(self.server, model, weights)
        except BaseException:
            with contextlib.suppress(Exception):
                self.server.call("finish_weight_update")
            with contextlib.suppress(Exception):
                self.server.call("resume")
            raise
        sent = time.monotonic()
        self.server.call("resume")
        return {"perf/weight_sync_pause_s": paused - started, "perf/weight_sync_transfer_s": sent - paused}

    def close(self) -> None:
        self.transfer.close()


class FileTransfer:
    """Merged weights through one file in /dev/shm (the built-in server on this host reads it).

    Streams: each tensor is written as it comes (`harness.weight_sync.wire.write_weights_file`), and the
    manifest, built on the way, is posted after.
    """

    kind = "file"

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = directory

    def send(self, server: ClientThread, model: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from harness.weight_sync.wire import default_weights_dir, write_weights_file

        path = Path(self.directory or default_weights_dir()) / f"agent-harness-weights-{uuid.uuid4().hex}.bin"
        server.call("start_weight_update")
        try:
            manifest = write_weights_file(weights, path)
            server.call("send_weight_manifest", {**manifest.to_update_info(), "path": str(path)})
            server.call("finish_weight_update")
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        pass


class BroadcastTransfer:
    """Merged weights broadcast over a process group the server joined (trainer = rank 0).

    The group: for the built-in server a torch.distributed one (`harness.weight_sync.wire.BroadcastGroup`);
    for a vLLM server `harness.weight_sync.vllm_nccl.VllmNcclGroup` (vLLM's stateless group and pynccl;
    `vllm_api`: fake vLLM classes for tests), whose /init_weight_transfer_engine and /update_weights bodies
    carry only the keys vLLM accepts. Either way `connect` runs the trainer's rendezvous and
    /init_weight_transfer_engine at the same time, as each waits for the other. Per sync: the manifest is
    derived from the parameters' metadata (no tensor gathered), /update_weights carries it on the client's
    loop thread while this thread gathers the tensors one by one and hands each closed bucket to a sender
    thread (the collective has no timeout; the HTTP call has one and returns the server's error). At most two
    buckets are held: the one being sent and the one being filled. Calling `send` per bucket broadcasts
    exactly what one `send` of all the tensors would: a bucket's own bucket plan is that one bucket.
    """

    kind = "broadcast"

    def __init__(
        self,
        *,
        device: torch.device | str = "cpu",
        buffer_size_bytes: int | None = None,
        vllm_api: Any = None,
    ) -> None:
        import torch

        from harness.weight_sync.wire import DEFAULT_BUFFER_SIZE_BYTES

        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.buffer_size_bytes = buffer_size_bytes or DEFAULT_BUFFER_SIZE_BYTES
        self.vllm_api = vllm_api
        self.group: Any = None
        self.vllm = False

    def connect(self, server: ClientThread, base_url: str) -> None:
        from harness.weight_sync.vllm_nccl import GenerationClientServer, VllmNcclGroup

        builtin = str(server.server_info().get("server", "")).startswith("agent-harness")
        address = _address_towards(base_url)
        port = _free_port(address)
        endpoint = GenerationClientServer(server.client)
        if builtin:
            self.group = server.run(self._connect_builtin, endpoint, address, port, server.timeout_s)
            return
        self.vllm = True  # VllmUnavailableError (an ImportError naming the fix) when vLLM is not installed
        self.group = server.run(
            VllmNcclGroup.connect_server,
            endpoint,
            master_address=address,
            master_port=port,
            device=self.device,
            timeout_s=server.timeout_s,
            vllm=self.vllm_api,
        )

    async def _connect_builtin(
        self, endpoint: WeightTransferServer, master_address: str, master_port: int, timeout_s: float
    ) -> BroadcastGroup:
        """The built-in server's group: the trainer (rank 0) hosts the store, the server's ranks follow."""
        import anyio

        from harness.weight_sync.vllm_nccl import group_world_size, init_info
        from harness.weight_sync.wire import BroadcastGroup

        world_size = group_world_size(await endpoint.get_world_size())
        connect = functools.partial(
            BroadcastGroup.connect,
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            backend=self.backend,
            timeout_s=timeout_s,
            device=self.device,
        )
        groups: list[BroadcastGroup] = []

        async def rendezvous() -> None:
            groups.append(await anyio.to_thread.run_sync(connect))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(rendezvous)
            body = {**init_info(master_address, master_port, world_size), "backend": self.backend}
            await endpoint.init_weight_transfer_engine(body)
        return groups[0]

    def send(self, server: ClientThread, model: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from harness.weight_sync.wire import WeightTransferError, plan_buckets

        if self.group is None:
            raise RuntimeError("the broadcast group is not connected")
        manifest = merged_manifest(model)
        if self.vllm:
            from harness.weight_sync.vllm_nccl import update_info

            info = update_info(manifest, self.buffer_size_bytes)  # only keys vLLM accepts
        else:
            info = {**manifest.to_update_info(), "packed": True, "buffer_size_bytes": self.buffer_size_bytes}
        server.call("start_weight_update")
        http = server.start("send_weight_manifest", info)
        buckets: queue.Queue = queue.Queue(maxsize=1)
        errors: list[BaseException] = []

        def send_buckets() -> None:
            try:
                while (bucket := buckets.get()) is not None:
                    self.group.send(bucket, self.buffer_size_bytes)
            except BaseException as exc:  # reported on the caller's thread
                errors.append(exc)

        sender = threading.Thread(target=send_buckets, name="weight-sync-broadcast", daemon=True)
        sender.start()

        def check() -> None:
            if errors:
                raise errors[0]
            if http.done() and http.exception() is not None:
                raise http.exception()  # type: ignore[misc]

        def hand_over(item: Any) -> None:
            while True:
                check()
                try:
                    buckets.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue

        try:
            for bucket in plan_buckets(manifest, self.buffer_size_bytes):
                tensors = []
                for index in bucket:
                    name, tensor = next(weights)
                    if name != manifest.names[index] or list(tensor.shape) != manifest.shapes[index]:
                        raise WeightTransferError(
                            f"weight {index} is {name} {list(tensor.shape)}, the manifest said "
                            f"{manifest.names[index]} {manifest.shapes[index]}"
                        )
                    tensors.append((name, tensor))
                hand_over(tensors)
            hand_over(None)
            while sender.is_alive():
                check()
                sender.join(timeout=0.2)
            check()
            http.result()
        except BaseException:
            with contextlib.suppress(queue.Full):
                buckets.put_nowait(None)
            raise
        server.call("finish_weight_update")

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()


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
        self.server.call("load_lora_adapter", name, str(directory))
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


# --- helpers ---------------------------------------------------------------------------------------------


def merged_manifest(model: Any) -> Any:
    """The WeightManifest `merged_named_parameters(model)` will yield, from metadata alone (no gathering)."""
    from harness.weight_sync.peft import served_parameters
    from harness.weight_sync.wire import WeightManifest

    names, dtypes, shapes = [], [], []
    for name, parameter in served_parameters(model):
        names.append(name)
        dtypes.append(str(parameter.dtype).removeprefix("torch."))
        shapes.append(list(parameter.shape))  # a DTensor's shape is the global one
    return WeightManifest(names, dtypes, shapes)


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


def _address_towards(base_url: str) -> str:
    """This host's address as the server sees it: loopback for a local server, else the routed interface."""
    if not base_url or is_local_url(base_url):
        return "127.0.0.1"
    parsed = urlparse(base_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname or "127.0.0.1", parsed.port or 80))
        return probe.getsockname()[0]


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


__all__ = [
    "LORA_DIR",
    "AdapterWeightSync",
    "BroadcastTransfer",
    "FileTransfer",
    "MergedWeightSync",
    "WeightSync",
    "WeightSyncPlan",
    "adapter_name",
    "build_weight_sync",
    "check_no_lm_head_adapter",
    "merged_manifest",
    "plan_weight_sync",
]

"""The trainer side of vLLM's NCCL weight-transfer protocol (merged weights into a running `vllm serve`).

`VllmNcclGroup` has the shape of `harness.weight_sync.wire.BroadcastGroup` (`connect`, `send`, `close`), so a
weight-sync loop can swap one for the other, but it forms its group the way a vLLM server expects: the
trainer is rank 0 of a `vllm.distributed.utils.StatelessProcessGroup` (it hosts the TCP store at
master_address:master_port), and the data plane is a `vllm.distributed.device_communicators.pynccl.
PyNcclCommunicator` on the trainer's CUDA device. vLLM's workers join from /init_weight_transfer_engine
as rank `dp_rank * (TP * PP) + rank_in_dp + rank_offset` (`worker_rank`), so the group holds
`server world size + 1` ranks and the trainer alone is rank 0.

Protocol, as vLLM's worker side reads it (vllm/distributed/weight_transfer/nccl_engine.py and
packed_tensor.py in vllm-project/vllm):

* /init_weight_transfer_engine takes `{"init_info": init_info(...)}`: master_address, master_port,
  rank_offset, world_size, and from vLLM 0.28 on the packed format's fields (packed, its buffer size),
  which older versions carry in each update instead (`TransferLayout`, chosen from the server's /version;
  vLLM builds a dataclass from the dict and rejects unknown keys).
  The HTTP call returns once every worker has joined, and the trainer's rendezvous returns once they
  have, so the two must run at the same time: `VllmNcclGroup.connect_server` runs the rendezvous on a
  background thread and the HTTP call on the caller's task, under one time limit.
* /update_weights takes `{"update_info": update_info(manifest, layout)}`: names, dtype_names (no
  "torch."), global shapes (before 0.28 also `packed: true`); while it is in flight the trainer calls
  `send`. The packed stream is a
  sequence of uint8 buckets: the manifest's tensors in order, each flattened to bytes and appended to the
  current bucket, which closes once its size exceeds the buffer size (default 1 GiB), so a bucket can
  exceed it by one tensor. This is `plan_buckets`; the receiver derives the same buckets from the
  manifest alone. A buffer size other than the default is announced as `packed_buffer_size_bytes`, which
  only vLLM versions whose NCCL update info has that field accept (older ones answer 400).
* vLLM's receiver views each tensor straight out of its bucket (`.view(dtype).view(*shape)`), which torch
  refuses for a tensor at a byte offset its dtype's size does not divide, and for a 0-d tensor:
  `check_vllm_layout` refuses such a manifest before anything is posted or sent (same-dtype checkpoints
  always pass).
* The sender packs on `num_buffers` (2) CUDA streams made once per group: for bucket k it waits for
  the broadcast that last used slot k % 2, packs on that slot's stream, broadcasts there, and moves on,
  so packing bucket k+1 overlaps the broadcast of bucket k.

NCCL has no timeout: run `send` on a background thread while the HTTP /update_weights call (which has
one) runs on the caller's thread, as `harness.weight_sync.transports.BroadcastTransfer` does (posting
`update_info(manifest)`, not a body of its own: vLLM rejects keys it does not know).

What of this has run against a real vLLM, and how it is tested: docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.weight_sync.wire import (
    DEFAULT_BUFFER_SIZE_BYTES,
    WeightManifest,
    WeightTransferError,
    plan_buckets,
)

if TYPE_CHECKING:
    import torch

    from harness.generation.protocol import ServerControl

VLLM_INSTALL_HINT = 'pip install "agent-harness[vllm]"'
DEFAULT_NUM_BUFFERS = 2
TRAINER_RANK = 0
RANK_OFFSET = 1


class VllmUnavailableError(ImportError):
    """vLLM is not installed, and the NCCL weight transfer to a vLLM server needs its classes."""


# ---------------------------------------------------------------------------------------------- vLLM API


@dataclass(frozen=True)
class VllmNcclApi:
    """The two vLLM classes the trainer side uses; tests pass fakes with the same call shapes.

    Attributes:
        stateless_process_group: has `create(host=, port=, rank=, world_size=[, store_timeout=])`
            returning a group; rank 0 hosts the TCP store (`vllm.distributed.utils.StatelessProcessGroup`).
        communicator: called as `communicator(group, device=device)`; the result has
            `broadcast(tensor, src=, stream=)` (`vllm.distributed.device_communicators.pynccl.
            PyNcclCommunicator`).
    """

    stateless_process_group: Any
    communicator: Any


def load_vllm_api() -> VllmNcclApi:
    """vLLM's classes, imported now; VllmUnavailableError (naming the fix) when vLLM is missing."""
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as exc:
        raise VllmUnavailableError(
            f"syncing weights into a vLLM server over NCCL needs vLLM on the trainer too "
            f"({exc}); install it with: {VLLM_INSTALL_HINT}"
        ) from exc
    return VllmNcclApi(stateless_process_group=StatelessProcessGroup, communicator=PyNcclCommunicator)


# ------------------------------------------------------------------------------------------ ranks, bodies


def group_world_size(server_world_size: int) -> int:
    """Ranks in the transfer group: every vLLM worker (GET /get_world_size: TP x PP x DP) plus the trainer."""
    if server_world_size < 1:
        raise ValueError(f"the server reports world size {server_world_size}; it needs at least 1 worker")
    return server_world_size + 1


def worker_rank(dp_rank: int, rank_in_dp: int, world_size_per_dp: int, rank_offset: int = RANK_OFFSET) -> int:
    """The rank a vLLM worker takes in the group (vLLM's NCCL engine, `init_transfer_engine`)."""
    return dp_rank * world_size_per_dp + rank_in_dp + rank_offset


@dataclass(frozen=True)
class TransferLayout:
    """Where a vLLM version reads the packed format's fields (packed, packed_buffer_size_bytes) of its NCCL
    weight transfer: in each /update_weights (before 0.28), or once in /init_weight_transfer_engine (0.28
    on, whose workers default to unpacked). Sending them where the server does not expect them is a 500
    after /start_weight_update, which leaves vLLM's weights unusable."""

    version: str
    packed_in_init: bool


MIN_VLLM_VERSION = (0, 26)


def transfer_layout(version: str | None) -> TransferLayout:
    """The layout of a vLLM server's version (its /version); an error naming the fix for others."""
    numbers = _version_numbers(version)
    if numbers is None or numbers < MIN_VLLM_VERSION:
        raise ValueError(
            f"merged weight sync to vLLM needs vLLM >= {'.'.join(map(str, MIN_VLLM_VERSION))} (its NCCL "
            f"weight-transfer engine); the server reports version {version!r}. Upgrade vLLM, or train a "
            "LoRA adapter and start vLLM with --enable-lora for adapter sync"
        )
    return TransferLayout(str(version), packed_in_init=numbers >= (0, 28))


def _version_numbers(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = []
    for part in str(version).split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def init_info(
    master_address: str,
    master_port: int,
    world_size: int,
    rank_offset: int = RANK_OFFSET,
    *,
    layout: TransferLayout | None = None,
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
) -> dict[str, Any]:
    """The body's `init_info` for /init_weight_transfer_engine: exactly the keys vLLM's NCCL engine takes
    (with `layout.packed_in_init`, the packed format's too)."""
    info: dict[str, Any] = {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
    }
    if layout is not None and layout.packed_in_init:
        info.update(packed=True, packed_buffer_size_bytes=int(buffer_size_bytes))
    return info


def update_info(
    manifest: WeightManifest,
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
    *,
    layout: TransferLayout | None = None,
) -> dict[str, Any]:
    """The body's `update_info` for /update_weights for a packed NCCL send of `manifest`.

    Before vLLM 0.28 (`layout.packed_in_init` false, or no layout) it says `packed: true`; the default
    buffer size is left implicit, another is announced as `packed_buffer_size_bytes`. Raises
    WeightTransferError for a manifest vLLM's receiver cannot unpack (`check_vllm_layout`), before anything
    is sent.
    """
    check_vllm_layout(manifest, buffer_size_bytes)
    info: dict[str, Any] = manifest.to_update_info()
    if layout is None or not layout.packed_in_init:
        info["packed"] = True
        if buffer_size_bytes != DEFAULT_BUFFER_SIZE_BYTES:
            info["packed_buffer_size_bytes"] = int(buffer_size_bytes)
    return info


# ----------------------------------------------------------------------------------------------- packing


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    import torch

    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def materialize(tensor: Any) -> torch.Tensor:
    """A full local tensor: an FSDP2 shard (DTensor) is gathered here, one parameter at a time."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def check_entry(manifest: WeightManifest, index: int, name: str, tensor: torch.Tensor) -> None:
    """Raise WeightTransferError unless `name`/`tensor` is the manifest's entry `index`."""
    expected = (manifest.names[index], manifest.dtype(index), manifest.shapes[index])
    actual = (name, tensor.dtype, list(tensor.shape))
    if actual != expected:
        raise WeightTransferError(
            f"tensor {index} is {name!r} {tensor.dtype} {list(tensor.shape)}, the manifest says "
            f"{expected[0]!r} {expected[1]} {expected[2]}"
        )


def pack_bucket(parts: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Concatenate the tensors' bytes, in order, into one uint8 tensor on `device` (default: the first's)."""
    import torch

    flats = [tensor_bytes(part) for part in parts]
    if device is not None:
        flats = [flat.to(device, non_blocking=True) for flat in flats]
    if not flats:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(flats)


def iter_packed_buckets(
    manifest: WeightManifest,
    named_tensors: Iterable[tuple[str, Any]],
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
    device: torch.device | str | None = None,
) -> Iterator[tuple[range, torch.Tensor]]:
    """The packed buckets of `named_tensors`, per `plan_buckets(manifest, buffer_size_bytes)`.

    Pulls one tensor at a time (a generator of FSDP gathers stays one parameter deep) and checks each
    against the manifest; raises WeightTransferError on a mismatch or a count that differs.
    """
    iterator = iter(named_tensors)
    for bucket in plan_buckets(manifest, buffer_size_bytes):
        yield bucket, pack_bucket(_take_bucket(manifest, bucket, iterator), device)
    if next(iterator, None) is not None:
        raise WeightTransferError(f"more tensors than the manifest's {len(manifest.names)}")


def _take_bucket(manifest: WeightManifest, bucket: range, iterator: Iterator[tuple[str, Any]]) -> list[Any]:
    parts = []
    for index in bucket:
        item = next(iterator, None)
        if item is None:
            raise WeightTransferError(f"{index} tensors, the manifest lists {len(manifest.names)}")
        name, tensor = item[0], materialize(item[1])
        check_entry(manifest, index, name, tensor)
        parts.append(tensor)
    return parts


def unpack_bucket(
    packed: torch.Tensor, manifest: WeightManifest, bucket: range
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one bucket, from the manifest alone: split by byte size, view as dtype, reshape.

    vLLM's receiver (`unpack_tensor`) does the same with views only, so it fails where a tensor starts at
    an offset its dtype's size does not divide, or is 0-d (`check_vllm_layout`); this copy clones there.
    """
    sizes = [manifest.nbytes(i) for i in bucket]
    if packed.numel() != sum(sizes):
        raise WeightTransferError(f"bucket holds {packed.numel()} bytes, the manifest needs {sum(sizes)}")
    tensors = []
    for index, piece in zip(bucket, packed.split(sizes), strict=True):
        dtype = manifest.dtype(index)
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()
        tensors.append((manifest.names[index], piece.view(dtype).view(manifest.shapes[index])))
    return tensors


def check_vllm_layout(manifest: WeightManifest, buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES) -> None:
    """Raise WeightTransferError where vLLM's receiver could not unpack the packed stream.

    It views each tensor straight out of the received bucket (`piece.contiguous().view(dtype)
    .view(*shape)`), which torch refuses for a tensor whose byte offset in its bucket is not a multiple
    of its dtype's size, and for a 0-d tensor. The server would fail mid-update and stay paused with
    partial weights, so the trainer refuses before sending. Same-dtype checkpoints always pass.
    """
    problems = []
    for bucket in plan_buckets(manifest, buffer_size_bytes):
        offset = 0
        for index in bucket:
            itemsize = manifest.dtype(index).itemsize
            if offset % itemsize:
                problems.append(
                    f"{manifest.names[index]} ({manifest.dtype_names[index]}) starts at byte {offset} of its "
                    f"bucket, not a multiple of {itemsize}"
                )
            if not manifest.shapes[index]:
                problems.append(f"{manifest.names[index]} is 0-d (vLLM reshapes with view(*shape))")
            offset += manifest.nbytes(index)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightTransferError(
            f"vLLM's packed receiver cannot unpack this manifest: {shown}. Order tensors so each starts "
            f"aligned (e.g. largest dtype first), or send such tensors as 1-d"
        )


# ----------------------------------------------------------------------------------------------- streams


class _NoStream:
    """Stands in for a CUDA stream where there is none (CPU buffers): every operation is immediate."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


def _is_cuda_stream(stream: Any) -> bool:
    return hasattr(stream, "cuda_stream")


def _on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    if not _is_cuda_stream(stream):
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def _current_stream(device: torch.device) -> Any:
    if device.type != "cuda":
        return _NoStream()
    import torch

    return torch.cuda.current_stream(device)


def _make_streams(device: torch.device, count: int) -> list[Any]:
    if device.type != "cuda":
        return [_NoStream() for _ in range(count)]
    import torch

    return [torch.cuda.Stream(device=device) for _ in range(count)]


# ------------------------------------------------------------------------------------------------- group


class VllmNcclGroup:
    """The trainer (rank 0) of vLLM's NCCL weight-transfer group; swaps in for `BroadcastGroup`.

    Usage (the trainer, once, then per sync; `harness.weight_sync.transports.BroadcastTransfer` does this):

        group = await VllmNcclGroup.connect_server(
            client, master_address=trainer_ip, master_port=port)   # a harness.generation ServerControl
        # per sync, between /start_weight_update and /finish_weight_update: a thread runs
        # group.send(named_tensors, manifest=manifest) while /update_weights carries update_info(manifest)
        group.close()
    """

    def __init__(
        self,
        communicator: Any,
        process_group: Any,
        rank: int,
        world_size: int,
        device: torch.device | str,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        streams: Sequence[Any] | None = None,
    ) -> None:
        """Args:
        streams: One per buffer, each with `synchronize()` and `wait_stream(stream)`; default: CUDA
            streams on `device` (made at the first send), or no-op ones for a CPU device.
        """
        import torch

        if num_buffers < 1:
            raise ValueError(f"num_buffers must be at least 1, got {num_buffers}")
        self._communicator = communicator
        self._process_group = process_group
        self.rank = rank
        self.world_size = world_size
        self.backend = "nccl"
        self.device = torch.device(device)
        self.num_buffers = num_buffers
        self._streams: list[Any] | None = list(streams) if streams is not None else None
        if self._streams is not None and len(self._streams) != num_buffers:
            raise ValueError(f"{len(self._streams)} streams for {num_buffers} buffers")
        self._lock = threading.Lock()

    # -------------------------------------------------------------- connect

    @classmethod
    def connect(
        cls,
        *,
        master_address: str,
        master_port: int,
        rank: int = TRAINER_RANK,
        world_size: int,
        backend: str = "nccl",
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        vllm: VllmNcclApi | None = None,
    ) -> VllmNcclGroup:
        """Host the group (rank 0) and return once every vLLM worker joined and NCCL is up.

        Blocks: run it while /init_weight_transfer_engine is in flight (`connect_server` does both).
        `timeout_s` bounds the TCP store's wait for the workers where vLLM's StatelessProcessGroup takes a
        store timeout; NCCL's own initialisation has none.

        Args:
            device: The trainer's CUDA device for the NCCL buffers (default: the current one).
            vllm: vLLM's classes (default: imported now; VllmUnavailableError without vLLM).
        """
        if rank != TRAINER_RANK:
            raise ValueError(f"the trainer is rank {TRAINER_RANK} of vLLM's group, not {rank}")
        if backend != "nccl":
            raise ValueError(f"vLLM's weight transfer speaks NCCL only, not {backend!r}")
        if world_size < 2:
            raise ValueError(f"world_size {world_size}: the group needs the trainer and at least one worker")
        api = vllm if vllm is not None else load_vllm_api()
        resolved = _trainer_device(device)
        create = api.stateless_process_group.create
        kwargs: dict[str, Any] = {"host": master_address, "port": int(master_port), "rank": rank}
        kwargs["world_size"] = world_size
        if _accepts(create, "store_timeout"):
            kwargs["store_timeout"] = max(1, math.ceil(timeout_s))
        process_group = create(**kwargs)
        communicator = api.communicator(process_group, device=resolved)
        if getattr(communicator, "disabled", False):
            raise RuntimeError(
                "vLLM's PyNcclCommunicator came up disabled (no NCCL library, or world size 1): "
                "its broadcasts would silently do nothing"
            )
        return cls(communicator, process_group, rank, world_size, resolved)

    @classmethod
    async def connect_server(
        cls,
        server: ServerControl,
        *,
        master_address: str,
        master_port: int,
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
        vllm: VllmNcclApi | None = None,
        poll_interval_s: float = 0.02,
        layout: TransferLayout | None = None,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
    ) -> VllmNcclGroup:
        """GET /get_world_size, then the rendezvous (a thread) and /init_weight_transfer_engine together.

        Raises the HTTP call's error as soon as it fails, the rendezvous's as soon as it fails, and
        TimeoutError when both have not finished within `timeout_s`, instead of waiting on NCCL forever.
        After a failure the rendezvous thread (a daemon) may stay blocked until the store times out.
        """
        import anyio

        api = vllm if vllm is not None else load_vllm_api()  # fail before touching the server
        world_size = group_world_size(await server.get_world_size())
        body = init_info(
            master_address, master_port, world_size, layout=layout, buffer_size_bytes=buffer_size_bytes
        )
        outcome: dict[str, Any] = {}
        finished = threading.Event()

        def rendezvous() -> None:
            try:
                outcome["group"] = cls.connect(
                    master_address=master_address,
                    master_port=master_port,
                    world_size=world_size,
                    timeout_s=timeout_s,
                    device=device,
                    vllm=api,
                )
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                finished.set()

        thread = threading.Thread(target=rendezvous, name="vllm-nccl-rendezvous", daemon=True)
        errors: list[BaseException] = []
        http_done = False

        async def call_server() -> None:
            nonlocal http_done
            try:
                await server.init_weight_transfer_engine(body)
                http_done = True
            except Exception as exc:
                errors.append(exc)
                tasks.cancel_scope.cancel()

        async def wait_rendezvous() -> None:
            while not finished.is_set():
                await anyio.sleep(poll_interval_s)
            if "error" in outcome:
                errors.append(outcome["error"])
                tasks.cancel_scope.cancel()

        started = time.monotonic()
        succeeded = False
        try:
            with anyio.move_on_after(timeout_s):
                async with anyio.create_task_group() as tasks:
                    thread.start()
                    tasks.start_soon(call_server)
                    tasks.start_soon(wait_rendezvous)
            if errors:
                raise errors[0]
            if not (http_done and "group" in outcome):
                waiting = [
                    what
                    for what, done in (
                        ("/init_weight_transfer_engine", http_done),
                        ("the rendezvous", finished.is_set()),
                    )
                    if not done
                ]
                raise TimeoutError(
                    f"the NCCL weight-transfer group did not form in {time.monotonic() - started:.0f} s "
                    f"(still waiting for {' and '.join(waiting)}; world size {world_size}, store at "
                    f"{master_address}:{master_port})"
                )
            succeeded = True
        finally:
            if not succeeded:
                _close_later(thread, outcome)
        return outcome["group"]

    # ----------------------------------------------------------------- send

    def send(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        *,
        manifest: WeightManifest | None = None,
    ) -> WeightManifest:
        """Broadcast the tensors from rank 0 in packed buckets; returns the manifest the server needs.

        Without `manifest`, `named_tensors` is materialised as a list to build one; with it (the one posted
        to /update_weights), the tensors are pulled one at a time and checked against it. Buckets follow
        `plan_buckets`; bucket k is packed and broadcast on stream k % num_buffers after the broadcast that
        last used that stream finished, so packing k + 1 overlaps sending k. Returns after every broadcast
        completed. A tensor that does not match the manifest raises WeightTransferError; buckets already
        broadcast stay sent (the server then fails or times out /update_weights and stays paused).
        """
        if self._communicator is None:
            raise RuntimeError("the group is closed")
        if self.rank != TRAINER_RANK:
            raise RuntimeError("only rank 0 (the trainer) sends")
        if manifest is None:
            named_tensors = list(named_tensors)
            manifest = WeightManifest.of(named_tensors)
        check_vllm_layout(manifest, buffer_size_bytes)
        with self._lock:  # one send at a time: the streams and buffers are shared
            self._send(manifest, named_tensors, buffer_size_bytes)
        return manifest

    def _send(
        self, manifest: WeightManifest, named_tensors: Iterable[tuple[str, Any]], buffer_size_bytes: int
    ) -> None:
        if self._streams is None:
            # Made once: the caching allocator keys blocks by stream, so fresh streams per send would
            # strand each send's buffers.
            self._streams = _make_streams(self.device, self.num_buffers)
        streams = self._streams
        producer = _current_stream(self.device)
        in_flight: list[torch.Tensor | None] = [None] * len(streams)
        iterator = iter(named_tensors)
        slot = 0
        try:
            for bucket in plan_buckets(manifest, buffer_size_bytes):
                stream = streams[slot]
                stream.synchronize()  # the broadcast that last used this slot is done
                in_flight[slot] = None
                parts = _take_bucket(manifest, bucket, iterator)
                # The parameters were written on the producer's stream (optimizer step, FSDP gather).
                stream.wait_stream(producer)
                with _on_stream(stream):
                    for part in parts:
                        if part.device.type == "cuda" and _is_cuda_stream(stream):
                            part.record_stream(stream)  # a freed temporary is not reused mid-copy
                    packed = pack_bucket(parts, self.device)
                    self._communicator.broadcast(packed, src=TRAINER_RANK, stream=stream)
                in_flight[slot] = packed
                slot = (slot + 1) % len(streams)
            if next(iterator, None) is not None:
                raise WeightTransferError(f"more tensors than the manifest's {len(manifest.names)}")
        finally:
            for stream in streams:
                stream.synchronize()

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Tear the group down (idempotent); the server's side goes when vLLM's engine shuts down."""
        communicator, self._communicator = self._communicator, None
        destroy = getattr(communicator, "destroy", None)
        if callable(destroy):
            with contextlib.suppress(Exception):
                destroy()
        self._process_group = None
        self._streams = None


def _trainer_device(device: torch.device | str | None) -> torch.device:
    import torch

    resolved = torch.device(device) if device is not None else torch.device("cuda")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _accepts(function: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _close_later(thread: threading.Thread, outcome: dict[str, Any]) -> None:
    """After a failed connect: close the group if the abandoned rendezvous still completes."""

    if thread.ident is None:  # never started
        return

    def reap() -> None:
        thread.join()
        group = outcome.get("group")
        if group is not None:
            group.close()

    threading.Thread(target=reap, name="vllm-nccl-reaper", daemon=True).start()


__all__ = [
    "DEFAULT_NUM_BUFFERS",
    "VLLM_INSTALL_HINT",
    "VllmNcclApi",
    "VllmNcclGroup",
    "VllmUnavailableError",
    "check_vllm_layout",
    "group_world_size",
    "init_info",
    "iter_packed_buckets",
    "load_vllm_api",
    "pack_bucket",
    "unpack_bucket",
    "update_info",
    "worker_rank",
]

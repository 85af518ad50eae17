"""Moving a model's weights from the trainer into a running generation server.

Two transports share one manifest (`WeightManifest`: names, dtype names, shapes, in order, as vLLM's
/update_weights takes them):

* file (one host, CPU or GPU): the trainer writes every tensor into one file under /dev/shm (a tmpfs, so the
  bytes stay in memory), each at the next 64-byte boundary after the previous one, and posts the manifest
  with the file's path (`update_info.path`, our extension of vLLM's protocol). The server maps the file,
  checks the manifest against its model, copies the tensors in, and the trainer deletes the file. Only
  the built-in server reads `path`; a vLLM server needs the broadcast transport.
* broadcast (GPU, or gloo on CPU): the trainer is rank 0 of a torch.distributed group that the server joins
  at /init_weight_transfer_engine (rank `rank_offset`, TCP store at master_address:master_port). Per sync,
  the trainer broadcasts the tensors packed into buckets while /update_weights carries the manifest: each
  tensor is flattened to bytes and appended to the current bucket, which closes once its size exceeds
  `buffer_size_bytes` (so one bucket can exceed it by one tensor); both sides derive the same buckets from
  the manifest alone (`plan_buckets`). NCCL has no timeout, so the trainer runs its side on a background
  thread and the HTTP call, which has one, on the caller's thread. The HTTP sequence and the packing rule
  are vLLM's, but the group is a plain torch.distributed one: a vLLM server forms its group through its
  own stateless process group and pynccl, which this class does not speak.
  With deltas (harness/weight_sync/deltas.py; update_info carries `delta_base`, the token of the weights
  they apply to, and every update to the built-in server a `token` of its own), each bucket is preceded by
  a header broadcast: per tensor, the number of changed elements it carries as positions and values, or -1
  for the whole tensor.

Who talks to it: on the trainer's side `harness.weight_sync.transports.FileTransfer` (`write_weights_file`)
and `harness.weight_sync.transports.BroadcastTransfer` (`BroadcastGroup`, rank 0); the built-in server's
routes (`harness/server/app.py`) read files and receive broadcasts, then `check_manifest` and
`copy_into_model`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.weight_sync.deltas import INDEX_BYTES, DeltaEncoder, SparseUpdate, apply_sparse, sparse_nbytes

if TYPE_CHECKING:
    import torch

DEFAULT_BUFFER_SIZE_BYTES = 1024**3
FILE_ALIGNMENT_BYTES = 64


class WeightTransferError(ValueError):
    """A manifest or a transfer does not fit the model (unknown name, wrong shape, bad dtype, short file)."""


class WeightDeltaError(WeightTransferError):
    """A weight delta against other weights than the server holds (the server answers 409: send whole)."""


@dataclass(frozen=True)
class WeightManifest:
    """The tensors a transfer carries, in order: checkpoint names, dtype names without "torch.", shapes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise WeightTransferError(
                f"manifest lists {len(self.names)} names, {len(self.dtype_names)} dtypes, "
                f"{len(self.shapes)} shapes"
            )

    @classmethod
    def of(cls, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> WeightManifest:
        return cls(
            names=[name for name, _ in named_tensors],
            dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
            shapes=[list(t.shape) for _, t in named_tensors],
        )

    @classmethod
    def from_update_info(cls, info: dict[str, Any]) -> WeightManifest:
        try:
            return cls(
                names=[str(n) for n in info["names"]],
                dtype_names=[str(d) for d in info["dtype_names"]],
                shapes=[[int(s) for s in shape] for shape in info["shapes"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightTransferError(
                f"update_info needs names, dtype_names and shapes lists: {exc}"
            ) from exc

    def to_update_info(self) -> dict[str, Any]:
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}

    def dtype(self, index: int) -> torch.dtype:
        return torch_dtype(self.dtype_names[index])

    def nbytes(self, index: int) -> int:
        return math.prod(self.shapes[index]) * self.dtype(index).itemsize

    def file_offsets(self) -> list[int]:
        """Byte offset of each tensor in the file layout (each at the next 64-byte boundary)."""
        offsets, position = [], 0
        for index in range(len(self.names)):
            position = _aligned(position)
            offsets.append(position)
            position += self.nbytes(index)
        return offsets

    def file_size(self) -> int:
        if not self.names:
            return 0
        return self.file_offsets()[-1] + self.nbytes(len(self.names) - 1)


def _aligned(position: int) -> int:
    """The first file offset at or after `position` where a tensor may start."""
    return -(-position // FILE_ALIGNMENT_BYTES) * FILE_ALIGNMENT_BYTES


def _view(packed: torch.Tensor, offset: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes `offset`..`offset + size` of a uint8 buffer as a flat tensor of `dtype` (copied first where the
    offset is not a multiple of the dtype's size: such a slice cannot be viewed as it)."""
    raw = packed[offset : offset + size]
    return (raw.clone() if offset % dtype.itemsize else raw).view(dtype)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightTransferError(f"{name!r} is not a torch dtype")
    return dtype


def plan_buckets(manifest: WeightManifest, buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES) -> list[range]:
    """Split the manifest's tensors, in order, into broadcast buckets (index ranges).

    A bucket closes right after the tensor that takes its size over `buffer_size_bytes`.
    """
    if buffer_size_bytes <= 0:
        raise ValueError(f"buffer_size_bytes must be positive, got {buffer_size_bytes}")
    buckets, start, size = [], 0, 0
    for index in range(len(manifest.names)):
        size += manifest.nbytes(index)
        if size > buffer_size_bytes:
            buckets.append(range(start, index + 1))
            start, size = index + 1, 0
    if start < len(manifest.names):
        buckets.append(range(start, len(manifest.names)))
    return buckets


def default_weights_dir() -> Path:
    """/dev/shm when it exists (memory-backed), else the temp directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    import tempfile

    return Path(tempfile.gettempdir())


def write_weights_file(named_tensors: Iterable[tuple[str, torch.Tensor]], path: str | Path) -> WeightManifest:
    """Write the tensors into `path` in the file layout as they come; the manifest of what was written.

    Any device: each tensor is copied to the CPU on its own, so a stream of FSDP2 gathers holds no more
    than its gathered buckets.
    """
    import torch

    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    position = 0
    with open(path, "wb") as file:
        for name, tensor in named_tensors:
            position = _aligned(position)
            file.seek(position)
            data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            file.write(memoryview(data.numpy()))
            position += data.numel()
            names.append(name)
            dtype_names.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
    manifest = WeightManifest(names, dtype_names, shapes)
    if manifest.file_size() != position:
        raise WeightTransferError(f"wrote {position} bytes, the manifest describes {manifest.file_size()}")
    return manifest


def read_weights_file(path: str | Path, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a file written by `write_weights_file`, as CPU views of the mapped file."""
    import torch

    size = manifest.file_size()
    actual = os.path.getsize(path)
    if actual < size:
        raise WeightTransferError(f"{path} holds {actual} bytes, the manifest needs {size}")
    if size == 0:
        return
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    for index, offset in enumerate(manifest.file_offsets()):
        raw = mapped[offset : offset + manifest.nbytes(index)]
        yield manifest.names[index], raw.view(manifest.dtype(index)).view(manifest.shapes[index])


def check_manifest(model: torch.nn.Module, manifest: WeightManifest) -> None:
    """Raise WeightTransferError unless every tensor names a parameter or buffer of that shape.

    Runs before any copy, so a bad manifest never leaves the model half updated.
    """
    targets = _targets(model)
    problems = []
    for index, name in enumerate(manifest.names):
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: no such parameter")
        elif list(target.shape) != manifest.shapes[index]:
            problems.append(f"{name}: shape {manifest.shapes[index]}, the model has {list(target.shape)}")
        else:
            dtype = manifest.dtype(index)
            if dtype.is_floating_point != target.dtype.is_floating_point:
                problems.append(f"{name}: dtype {dtype} cannot be copied into {target.dtype}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightTransferError(f"weight update does not fit the model: {shown}")


def copy_into_model(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor | SparseUpdate]]
) -> int:
    """Copy each tensor into the parameter or buffer of that name (casting dtype, moving device); a
    SparseUpdate's values go to its positions alone."""
    import torch

    targets = _targets(model)
    count = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            if isinstance(tensor, SparseUpdate):
                apply_sparse(targets[name], tensor)
            else:
                targets[name].copy_(tensor, non_blocking=False)
            count += 1
    return count


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # remove_duplicate=False: a tied lm_head answers to both of its names.
    targets: dict[str, torch.Tensor] = dict(model.named_buffers(remove_duplicate=False))
    targets.update(model.named_parameters(remove_duplicate=False))
    return targets


class BroadcastGroup:
    """A torch.distributed process group between the trainer (rank 0) and a generation server.

    Not the default process group: a trainer already running FSDP keeps its own, and the server may
    re-join after a restart. Use `connect` on both sides (the trainer's call hosts the TCP store and
    blocks until every rank arrived).

    Args:
        backend: "nccl" (CUDA tensors, the production path) or "gloo" (CPU, for tests and CPU runs).
    """

    def __init__(
        self, process_group: Any, store: Any, rank: int, world_size: int, backend: str, device: torch.device
    ) -> None:
        self._group = process_group
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.bytes_sent = 0  # payload broadcast by `send` so far

    @classmethod
    def connect(
        cls,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "nccl",
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
    ) -> BroadcastGroup:
        """Join (rank > 0) or host (rank 0) the group; returns once every rank has joined.

        Args:
            device: Where this rank's buffers live: for nccl a CUDA device (default: the current one), for
                gloo the CPU.
        """
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            resolved = (
                torch.device(device)
                if device is not None
                else torch.device("cuda", torch.cuda.current_device())
            )
            if resolved.index is None:
                resolved = torch.device("cuda", torch.cuda.current_device())
        else:
            resolved = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        elif backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            raise ValueError(f"unknown backend {backend!r} (nccl or gloo)")
        # A first collective makes the group real on every rank before connect() returns.
        cls._broadcast(group, torch.zeros(1, device=resolved))
        return cls(group, store, rank, world_size, backend, resolved)

    @staticmethod
    def _broadcast(group: Any, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([tensor], options).wait()

    def send(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        *,
        encoder: DeltaEncoder | None = None,
        as_delta: bool = False,
    ) -> WeightManifest:
        """Broadcast the tensors, packed in buckets (rank 0). Returns the manifest the receivers need.

        `encoder` remembers what was sent (`harness/weight_sync/deltas.py`); with `as_delta` each bucket is
        a header first (per tensor: the number of elements of its SparseUpdate, or -1 for whole), then the
        tensors as encoded against what the encoder remembers. `bytes_sent` counts what went out.
        """
        import torch

        if self.rank != 0:
            raise RuntimeError("only rank 0 (the trainer) sends")
        manifest = WeightManifest.of(named_tensors)
        device = self.device
        for bucket in plan_buckets(manifest, buffer_size_bytes):
            tensors = [
                (named_tensors[i][0], named_tensors[i][1].detach().to(device).contiguous()) for i in bucket
            ]
            items = [
                encoder.encode(name, tensor, as_delta=as_delta) if encoder is not None else tensor
                for name, tensor in tensors
            ]
            if as_delta:
                counts = [item.values.numel() if isinstance(item, SparseUpdate) else -1 for item in items]
                self._send_bytes(torch.tensor(counts, dtype=torch.int64, device=device))
            parts = []
            for item in items:
                pieces = (item.positions, item.values) if isinstance(item, SparseUpdate) else (item,)
                parts += [piece.reshape(-1).view(torch.uint8) for piece in pieces]
            self._send_bytes(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device))
        return manifest

    def _send_bytes(self, tensor: torch.Tensor) -> None:
        self._broadcast(self._group, tensor)
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def receive(
        self,
        manifest: WeightManifest,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        *,
        as_delta: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor | SparseUpdate]]:
        """The tensors rank 0 broadcasts for `manifest`, bucket by bucket (ranks > 0); with `as_delta`, as
        `send` encodes them: some as SparseUpdates (`copy_into_model` applies both kinds)."""
        import torch

        device = self.device
        for bucket in plan_buckets(manifest, buffer_size_bytes):
            counts = [-1] * len(bucket)
            if as_delta:
                header = torch.empty(len(bucket), dtype=torch.int64, device=device)
                self._broadcast(self._group, header)
                counts = header.tolist()
            sizes = [
                manifest.nbytes(i) if count < 0 else sparse_nbytes(count, manifest.dtype(i).itemsize)
                for i, count in zip(bucket, counts, strict=True)
            ]
            packed = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            self._broadcast(self._group, packed)
            offset = 0
            for index, size, count in zip(bucket, sizes, counts, strict=True):
                dtype = manifest.dtype(index)
                if count < 0:
                    whole = _view(packed, offset, size, dtype).view(manifest.shapes[index])
                    yield manifest.names[index], whole
                else:
                    positions = _view(packed, offset, count * INDEX_BYTES, torch.int32)
                    values = _view(packed, offset + count * INDEX_BYTES, count * dtype.itemsize, dtype)
                    yield manifest.names[index], SparseUpdate(positions, values)
                offset += size

    def close(self) -> None:
        """Tear the group down (idempotent)."""
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
        self._store = None


__all__ = [
    "DEFAULT_BUFFER_SIZE_BYTES",
    "BroadcastGroup",
    "WeightDeltaError",
    "WeightManifest",
    "WeightTransferError",
    "check_manifest",
    "copy_into_model",
    "default_weights_dir",
    "plan_buckets",
    "read_weights_file",
    "torch_dtype",
    "write_weights_file",
]

"""Gathering FSDP2-sharded weights for a merged weight sync: in buckets, one collective per bucket.

Under FSDP2 (harness/training/fsdp.py) every parameter is a DTensor whose dim 0 is split over the processes
the way `torch.chunk` splits it: ceil(rows / world) rows per process, the last ones fewer or none. Gathering
each parameter on its own (`DTensor.full_tensor()`) costs one collective per parameter, ~300 for a Qwen3,
each with its own latency. Here the weights are gathered in buckets instead:

    items = [GatherItem(name, (weight,)), GatherItem(lora_name, (base, lora_A, lora_B), merge)]
    for name, tensor in gather_in_buckets(items, bucket_size_bytes=DEFAULT_GATHER_BUCKET_BYTES):
        ...  # rank 0: every item's full tensor, in order; the other ranks: nothing, but they must iterate

Per bucket (`plan_gather_buckets`: consecutive items, at most `bucket_size_bytes` of gathered bytes unless
one item alone is larger), every process copies its shards of the bucket's tensors into one flat byte buffer,
each shard in a slot of ceil(rows / world) rows (so every process sends the same number of bytes, as the
collective needs; the rows a shorter shard lacks are never read), and one `torch.distributed.gather` brings
the buffers to rank 0, which cuts each full tensor out of them (`torch.cat` of the processes' rows) and
hands it to `GatherItem.combine` (a LoRA layer's merge: the base weight and its factors arrive together)
before yielding it. The next bucket's gather is issued before the current one is handed over, so the
collective overlaps rank 0's copying into the transport; rank 0 holds at most two gathered buckets plus the
tensor being handed over, the other ranks two buckets of their own shards.

Gather to rank 0 rather than all-gather: only rank 0 sends to the server, and the other processes then never
hold a gathered bucket (benchmarks/bench_weight_sync.py --gather measures both). `all_ranks=True`
all-gathers instead, for callers that need the full tensors everywhere (tests compare ranks).

Who talks to it: `harness.weight_sync.peft.merged_named_parameters` builds the items (served names, LoRA
merges) and is iterated on every process by `MergedWeightSync` (strategies.py) and by the trainer's
`saved_model_for_server`; the collectives run on the parameters' own device mesh (FSDP2's process group).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_GATHER_BUCKET_BYTES = 256 << 20
SLOT_ALIGNMENT_BYTES = 16  # every slot starts where any dtype can be viewed from the byte buffer


class ShardLayoutError(ValueError):
    """A sharded parameter not laid out as FSDP2's `fully_shard` on one mesh dimension lays it out."""


@dataclass(frozen=True)
class GatherItem:
    """One tensor to yield: `tensors` are gathered together (sharded DTensors or plain full tensors), and
    `combine` turns their full forms into the tensor yielded under `name` (None: the first one as it is).
    `dtype`: the dtype the sharded tensors travel in, cast to before they are packed (None: their own);
    the cast commutes with gathering, so rank 0 gets what casting the full tensor would give."""

    name: str
    tensors: tuple[Any, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    dtype: Any = None


def shard_rows(num_rows: int, world_size: int) -> list[range]:
    """The rows of dim 0 each process holds under FSDP2 (`torch.chunk`'s split, empty ranges at the end).

    >>> shard_rows(5, 2), shard_rows(5, 4)
    ([range(0, 3), range(3, 5)], [range(0, 2), range(2, 4), range(4, 5), range(5, 5)])
    """
    per_rank = -(-num_rows // world_size)
    return [range(min(r * per_rank, num_rows), min((r + 1) * per_rank, num_rows)) for r in range(world_size)]


def plan_gather_buckets(sizes: Sequence[int], bucket_size_bytes: int) -> list[range]:
    """Split items of these gathered sizes (bytes), in order, into buckets (index ranges): a bucket takes
    items while they fit in `bucket_size_bytes`; an item larger than that is a bucket of its own.

    >>> plan_gather_buckets([4, 4, 4, 10, 0, 1], 8)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    """
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    buckets: list[range] = []
    start, used = 0, 0
    for index, size in enumerate(sizes):
        if used + size > bucket_size_bytes and index > start:
            buckets.append(range(start, index))
            start, used = index, 0
        used += size
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


@dataclass(frozen=True)
class _Slot:
    """Where one sharded tensor's shard sits in each process's part of a bucket's buffer."""

    offset: int  # bytes from the start of a process's part
    shape: tuple[int, ...]
    dtype: Any
    rows: list[range]  # each process's rows of dim 0

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def padded_bytes(self) -> int:
        return max(len(rows) for rows in self.rows) * self.row_bytes


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGNMENT_BYTES) * SLOT_ALIGNMENT_BYTES


class _Layout:
    """The items' sharded tensors, checked against FSDP2's layout: their one mesh and each one's rows."""

    def __init__(self, items: Sequence[GatherItem]) -> None:
        from torch.distributed.tensor import DTensor, Shard

        self.items = items
        self.mesh: Any = None
        self.rows: dict[int, list[range]] = {}  # id(tensor) -> each process's rows of dim 0
        for item in items:
            for tensor in item.tensors:
                if not isinstance(tensor, DTensor):
                    continue
                mesh = tensor.device_mesh
                if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),) or tensor.dim() == 0:
                    problem = f"is placed {tuple(tensor.placements)} on a {mesh.ndim}-D mesh"
                    raise ShardLayoutError(_layout_problem(item.name, problem))
                if self.mesh is None:
                    self.mesh = mesh
                elif mesh != self.mesh:
                    problem = f"is sharded on {mesh}, earlier parameters on {self.mesh}"
                    raise ShardLayoutError(_layout_problem(item.name, problem))
                rows = shard_rows(tensor.shape[0], mesh.size())
                held, expected = tensor.to_local().shape[0], len(rows[mesh.get_local_rank()])
                if held != expected:
                    problem = f"has {held} of its {tensor.shape[0]} rows here, torch.chunk's split {expected}"
                    raise ShardLayoutError(_layout_problem(item.name, problem))
                self.rows[id(tensor)] = rows

    def slots(self, bucket: range) -> tuple[dict[int, _Slot], int]:
        """The slots of a bucket's sharded tensors (by id) and the bytes of one process's part."""
        slots: dict[int, _Slot] = {}
        offset = 0
        for index in bucket:
            item = self.items[index]
            for tensor in item.tensors:
                rows = self.rows.get(id(tensor))
                if rows is not None and id(tensor) not in slots:
                    dtype = item.dtype or tensor.dtype
                    slots[id(tensor)] = slot = _Slot(offset, tuple(tensor.shape), dtype, rows)
                    offset += _aligned(slot.padded_bytes)
        return slots, offset

    def gathered_bytes(self, index: int) -> int:
        """The bytes item `index` adds to a bucket's gathered buffer (0 for one without a sharded tensor)."""
        return self.mesh.size() * self.slots(range(index, index + 1))[1]


def _layout_problem(name: str, problem: str) -> str:
    return (
        f"{name} {problem}: the bucketed gather reads FSDP2's layout (fully_shard on one mesh dimension, "
        "dim 0 split as torch.chunk splits it); pass bucket_size_bytes=None to merged_named_parameters to "
        "gather one parameter at a time"
    )


def gather_in_buckets(
    items: Sequence[GatherItem],
    bucket_size_bytes: int = DEFAULT_GATHER_BUCKET_BYTES,
    *,
    all_ranks: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every item's full tensor, in order, on rank 0 of the parameters' mesh (on every process with
    `all_ranks`); one collective per bucket (module docstring). Every process iterates it to the end."""
    layout = _Layout(items)
    if layout.mesh is None:
        raise ShardLayoutError(
            "none of the tensors to gather is sharded (no DTensor): read them as they are, without gathering"
        )
    receiving = all_ranks or layout.mesh.get_local_rank() == 0
    sizes = [layout.gathered_bytes(index) for index in range(len(items))]
    pending: _Gathered | None = None
    for bucket in plan_gather_buckets(sizes, bucket_size_bytes):
        issued = _Gathered(layout, bucket, receiving=receiving, all_ranks=all_ranks)
        if pending is not None:
            yield from pending.tensors()
        pending = issued
    if pending is not None:
        yield from pending.tensors()


class _Gathered:
    """One bucket's collective, issued at construction; `tensors()` waits for it and yields the bucket's full
    tensors on a receiving process (nothing on the others)."""

    def __init__(self, layout: _Layout, bucket: range, *, receiving: bool, all_ranks: bool) -> None:
        import torch
        import torch.distributed as dist

        self.layout = layout
        self.bucket = bucket
        self.receiving = receiving
        self.slots, self.part_bytes = layout.slots(bucket)
        self.work: Any = None
        self.sent: torch.Tensor | None = None  # held until the collective is done
        self.received: torch.Tensor | None = None  # every process's part, in rank order
        if not self.slots:  # only plain tensors: nothing to gather
            return
        mesh = layout.mesh
        group, world = mesh.get_group(), mesh.size()
        device = _collective_device(mesh)
        self.sent = torch.empty(self.part_bytes, dtype=torch.uint8, device=device)
        for index in bucket:
            for tensor in layout.items[index].tensors:
                slot = self.slots.get(id(tensor))
                if slot is not None:
                    local = tensor.to_local()
                    end = slot.offset + local.numel() * slot.dtype.itemsize
                    self.sent[slot.offset : end].view(slot.dtype).view(local.shape).copy_(local)
        if receiving:
            self.received = torch.empty(world * self.part_bytes, dtype=torch.uint8, device=device)
        if all_ranks:
            self.work = dist.all_gather_into_tensor(self.received, self.sent, group=group, async_op=True)
        else:
            parts = list(self.received.chunk(world)) if self.received is not None else None
            self.work = dist.gather(
                self.sent, parts, dst=dist.get_global_rank(group, 0), group=group, async_op=True
            )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.work is not None:
            self.work.wait()
        self.sent = None
        if self.receiving:
            for index in self.bucket:
                item = self.layout.items[index]
                yield item.name, _combined(item, [self._full(tensor) for tensor in item.tensors])
        self.received = None

    def _full(self, tensor: Any) -> torch.Tensor:
        import torch

        slot = self.slots.get(id(tensor))
        if slot is None:
            return tensor  # a plain tensor: already full on every process
        assert self.received is not None
        pieces = []
        for rank, rows in enumerate(slot.rows):
            start = rank * self.part_bytes + slot.offset
            raw = self.received[start : start + len(rows) * slot.row_bytes]
            pieces.append(raw.view(slot.dtype).view(len(rows), *slot.shape[1:]))
        return torch.cat(pieces)


def _combined(item: GatherItem, full: list[torch.Tensor]) -> torch.Tensor:
    return item.combine(full) if item.combine is not None else full[0]


def _collective_device(mesh: Any) -> torch.device:
    """The device the mesh's collectives run on: the CPU for gloo, the current GPU for NCCL (shards FSDP2
    offloaded to the CPU are copied there)."""
    import torch

    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


__all__ = [
    "DEFAULT_GATHER_BUCKET_BYTES",
    "GatherItem",
    "ShardLayoutError",
    "gather_in_buckets",
    "plan_gather_buckets",
    "shard_rows",
]

"""Weight deltas: after the first sync, send only the elements that changed since the last one.

A policy trained in float32 and served in bf16 changes little per step once rounded: an optimizer step of a
small learning rate moves most weights by less than half a bf16 step, so most served values stay bit for
bit what they were (Hugging Face's write-up on delta weight sync: 1.2 GB down to 20-35 MB a step for a 0.6B
model). Where the link is the limit (a broadcast to a server on another host), sending those elements alone
is the saving. Used by `BroadcastTransfer(deltas=True)` (`AsyncGRPOConfig.weight_sync_deltas`) towards the
built-in server; the transports to a server on this host (CUDA IPC, the shared-memory file) copy at memory
speed, and vLLM's receiving side takes dense tensors only.

How: the sender keeps the last values it sent of every tensor (`DeltaEncoder`: one copy of the served
weights, in the sent dtype, on the transfer's device). Each tensor of a later sync is compared with it bit
for bit; where fewer than a third of its elements changed (`SPARSE_SHARE`: below that, int32 positions and
values take fewer bytes than the tensor), it travels as a `SparseUpdate` (the changed positions in the
flattened tensor, and their values), else whole. The receiver writes those values at those positions in
place, so after each sync it holds exactly what the sender holds: a delta is only valid against the very
weights it was computed from, which the server checks (`harness/server/app.py`, the update's `delta_base`
against the token of the last update it applied) before applying one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

# Positions travel as int32: a tensor of 2**31 elements or more always travels whole.
INDEX_BYTES = 4
MAX_SPARSE_NUMEL = 2**31 - 1
SPARSE_SHARE = 1 / 3  # most changed elements, as a share of a tensor's, for it to travel as a SparseUpdate


class SparseUpdate(NamedTuple):
    """The changed elements of one tensor: int32 `positions` in its flattened order, and their `values`."""

    positions: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.positions.numel() * INDEX_BYTES + self.values.numel() * self.values.element_size()


def sparse_nbytes(count: int, itemsize: int) -> int:
    """Bytes of a SparseUpdate of `count` elements of `itemsize` bytes each."""
    return count * (INDEX_BYTES + itemsize)


def apply_sparse(target: torch.Tensor, update: SparseUpdate) -> None:
    """Write the update's values at its positions of `target` (in place, any strides)."""
    import torch

    positions = update.positions.to(device=target.device, dtype=torch.long)
    values = update.values.to(device=target.device, dtype=target.dtype)
    if target.is_contiguous():
        target.view(-1).index_copy_(0, positions, values)
    else:
        target.index_put_(torch.unravel_index(positions, target.shape), values)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flattened: equal only where bit for bit equal
    (so a NaN equals itself and -0.0 differs from 0.0)."""
    import torch

    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.reshape(-1).view(integer)


class DeltaEncoder:
    """The sender's side: remembers what it sent, tensor by tensor, and encodes a tensor against it."""

    def __init__(self) -> None:
        self._sent: dict[str, torch.Tensor] = {}

    def remembers(self, names: list[str]) -> bool:
        """Whether a delta can be computed for every one of `names`."""
        return all(name in self._sent for name in names)

    def remembered(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """The tensors last sent under `names`, in that order (every one must be remembered)."""
        return [(name, self._sent[name]) for name in names]

    def encode(self, name: str, tensor: torch.Tensor, *, as_delta: bool) -> torch.Tensor | SparseUpdate:
        """`tensor` (on the transfer's device) as it travels: whole, or (`as_delta`, and few elements
        changed since the last one of this name) as a SparseUpdate. Remembers it either way."""
        import torch

        previous = self._sent.get(name)
        if previous is None or previous.shape != tensor.shape or previous.dtype != tensor.dtype:
            self._sent[name] = tensor.detach().clone()
            return tensor
        changed = None
        if as_delta and tensor.numel() <= MAX_SPARSE_NUMEL:
            changed = torch.ne(_bits(tensor), _bits(previous)).nonzero().squeeze(1)
        previous.copy_(tensor)
        if changed is None or changed.numel() > SPARSE_SHARE * tensor.numel():
            return tensor
        return SparseUpdate(changed.to(torch.int32), tensor.reshape(-1)[changed])


__all__ = [
    "INDEX_BYTES",
    "SPARSE_SHARE",
    "DeltaEncoder",
    "SparseUpdate",
    "apply_sparse",
    "sparse_nbytes",
]

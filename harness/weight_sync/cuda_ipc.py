"""CUDA IPC: one process's GPU buffer opened by another process on the same host, without copying.

The trainer packs merged weights into a CUDA buffer it keeps (`IpcTransfer` in transports.py) and sends
the buffer's IPC handle, as plain JSON, in the /update_weights body; the built-in server opens the same
memory (`open_buffer`) and copies each tensor's bytes into its model (`tensors_in`). Nothing is written
to disk or sent over a socket but the handle, so a sync costs two device copies.

The handle is the argument list `torch.multiprocessing.reductions.reduce_tensor` produces for a CUDA
tensor (the device, the memory and reference-counter handles, sizes and offsets), which the receiver
hands to torch's own `rebuild_cuda_tensor`, with the device named by its UUID (the two processes may
number their GPUs differently; the server must see the trainer's GPU, which the plan checks against the
UUIDs the server reports). It crosses as JSON, never as a pickle: the only classes a
body may name are torch.Tensor and torch.TypedStorage, and the only dtype uint8, so a request to the
server cannot make it construct anything else.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from harness.weight_sync.wire import WeightManifest

__all__ = [
    "ALIGNMENT",
    "IpcError",
    "device_uuid",
    "open_buffer",
    "share_buffer",
    "tensors_in",
    "visible_device_uuids",
]

ALIGNMENT = 256  # bytes: every tensor starts at a multiple, so each view is aligned for its dtype


class IpcError(ValueError):
    """An IPC handle the receiver will not open (malformed, or naming something other than a buffer)."""


def share_buffer(buffer: torch.Tensor) -> dict[str, Any]:
    """The JSON-able IPC handle of a contiguous uint8 CUDA tensor (see the module docstring)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise IpcError("only a contiguous uint8 CUDA tensor can be shared")
    _, args = reduce_tensor(buffer)
    return {"args": [_encode(arg) for arg in args], "device_uuid": device_uuid(buffer.device.index or 0)}


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`: what names a GPU the same way in every process,
    whatever each one's CUDA_VISIBLE_DEVICES numbers it."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def visible_device_uuids() -> list[str]:
    """The UUIDs of the CUDA devices this process can open memory on (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [device_uuid(index) for index in range(torch.cuda.device_count())]


def open_buffer(handle: Any) -> torch.Tensor:
    """The uint8 CUDA tensor another process shared with `share_buffer` (cached by torch per handle)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = handle.get("args") if isinstance(handle, dict) else None
    if not isinstance(args, list) or len(args) < 6:
        raise IpcError(f"an IPC handle is {{'args': [...]}} as share_buffer makes it, got {handle!r:.200}")
    decoded = [_decode(arg) for arg in args]
    import torch

    if decoded[0] is not torch.Tensor or decoded[4] is not torch.TypedStorage or decoded[5] != torch.uint8:
        raise IpcError("an IPC handle must describe a uint8 tensor over a storage")
    uuid = handle.get("device_uuid")
    if uuid is not None:  # the sender's device index means nothing here; its UUID does
        visible = visible_device_uuids()
        if uuid not in visible:
            raise IpcError(
                f"the trainer's GPU {uuid} is not visible to this process (its CUDA_VISIBLE_DEVICES); "
                "start the server with that GPU visible, or sync through the file"
            )
        decoded[6] = visible.index(uuid)
    return rebuild_cuda_tensor(*decoded)


def tensors_in(
    buffer: torch.Tensor, manifest: WeightManifest, offsets: Sequence[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of each manifest tensor at its byte offset in `buffer`."""
    if len(offsets) != len(manifest.names):
        raise IpcError(f"{len(offsets)} offsets for {len(manifest.names)} tensors")
    for index, name in enumerate(manifest.names):
        dtype, shape = manifest.dtype(index), manifest.shapes[index]
        numel = 1
        for size in shape:
            numel *= size
        start = int(offsets[index])
        end = start + numel * dtype.itemsize
        if start < 0 or start % ALIGNMENT or end > buffer.numel():
            raise IpcError(f"{name}: bytes {start}..{end} are not an aligned range of the shared buffer")
        yield name, buffer[start:end].view(dtype).view(shape)


_CLASSES = ("Tensor", "TypedStorage")


def _encode(value: Any) -> Any:
    import torch

    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        if value.__name__ not in _CLASSES:
            raise IpcError(f"cannot share a {value.__name__}")
        return {"class": value.__name__}
    if isinstance(value, tuple | list):
        return [_encode(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise IpcError(f"unexpected value in an IPC handle: {type(value).__name__}")


def _decode(value: Any) -> Any:
    import torch

    if isinstance(value, dict):
        if "bytes" in value:
            try:
                return base64.b64decode(value["bytes"], validate=True)
            except (binascii.Error, TypeError) as exc:
                raise IpcError(f"an IPC handle's bytes are not base64: {exc}") from exc
        if value.get("dtype") == "uint8":
            return torch.uint8
        if value.get("class") in _CLASSES:
            return getattr(torch, value["class"])
        raise IpcError(f"an IPC handle names something it may not: {value!r:.100}")
    if isinstance(value, list):
        return tuple(_decode(item) for item in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise IpcError(f"unexpected value in an IPC handle: {value!r:.100}")

"""The CUDA IPC handle's codec and the buffer layout, on CPU (the transfer itself runs in
tests/test_server_gpu.py): a handle crosses as JSON and can name nothing but a uint8 buffer."""

from __future__ import annotations

import json

import pytest
import torch

from harness.weight_sync.cuda_ipc import ALIGNMENT, IpcError, _decode, _encode, open_buffer, tensors_in
from harness.weight_sync.transports import _aligned
from harness.weight_sync.wire import WeightManifest

# The shape of what torch's reduce_tensor gives for a CUDA tensor (torch 2.11 and 2.13).
HANDLE_ARGS = (
    torch.Tensor,
    (4096,),
    (1,),
    0,
    torch.TypedStorage,
    torch.uint8,
    0,
    b"\x01\x02ipc",
    1 << 21,
    0,
    b"ref-counter",
    128,
    b"\x00event",
    True,
)


def test_a_handle_survives_json_and_decodes_to_the_same_arguments():
    encoded = json.loads(json.dumps([_encode(arg) for arg in HANDLE_ARGS]))
    assert tuple(_decode(arg) for arg in encoded) == HANDLE_ARGS


def handle_of(cls="Tensor", storage="TypedStorage", dtype=None) -> dict:
    return {"args": [{"class": cls}, [4], [1], 0, {"class": storage}, dtype or {"dtype": "uint8"}]}


@pytest.mark.parametrize(
    ("handle", "message"),
    [
        (None, "'args'"),
        ({"args": "not a list"}, "'args'"),
        ({"args": [1, 2]}, "'args'"),
        (handle_of(cls="Module"), "may not"),
        (handle_of(dtype={"dtype": "float32"}), "may not"),
        (handle_of(storage="Tensor"), "uint8 tensor"),
        (handle_of(dtype={"bytes": "%%"}), "base64"),
        (handle_of(dtype={"__reduce__": "os.system"}), "may not"),
    ],
)
def test_open_buffer_refuses_what_is_not_a_uint8_buffer_handle(handle, message):
    with pytest.raises(IpcError, match=message):
        open_buffer(handle)


def test_only_buffers_classes_and_plain_values_can_be_encoded():
    with pytest.raises(IpcError, match="cannot share a Module"):
        _encode(torch.nn.Module)
    with pytest.raises(IpcError, match="unexpected value"):
        _encode(object())
    with pytest.raises(IpcError, match="contiguous uint8 CUDA"):
        from harness.weight_sync.cuda_ipc import share_buffer

        share_buffer(torch.zeros(8, dtype=torch.uint8))


def test_tensors_are_read_at_aligned_offsets_and_bad_offsets_are_refused():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7)), ("c", torch.randn(2).half())]
    manifest = WeightManifest.of(tensors)
    offsets, end = [], 0
    for _, tensor in tensors:
        offsets.append(end)
        end = _aligned(end + tensor.numel() * tensor.element_size())
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    buffer = torch.zeros(end, dtype=torch.uint8)
    for (_, tensor), offset in zip(tensors, offsets, strict=True):
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        buffer[offset : offset + raw.numel()] = raw
    read = dict(tensors_in(buffer, manifest, offsets))
    for name, tensor in tensors:
        assert torch.equal(read[name], tensor)
    with pytest.raises(IpcError, match="2 offsets for 3 tensors"):
        list(tensors_in(buffer, manifest, offsets[:2]))
    with pytest.raises(IpcError, match="aligned range"):
        list(tensors_in(buffer, manifest, [0, 8, offsets[2]]))  # misaligned
    with pytest.raises(IpcError, match="aligned range"):
        list(tensors_in(buffer, manifest, [0, offsets[1], end]))  # past the end

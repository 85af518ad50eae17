"""The trainer side of vLLM's NCCL weight transfer (`harness.weight_sync.vllm_nccl`), without vLLM where
possible.

The packing is checked against a transcription of vLLM's receiver (`packed_nccl_broadcast_consumer` in
vllm/distributed/weight_transfer/packed_tensor.py: bucket boundaries from the manifest alone, split by
byte size, view as the dtype, reshape). The connect choreography runs with fake vLLM classes and a fake
server injected through `vllm=` and the `server` argument. The `gpu` tests need CUDA; the last also needs
vLLM and a running `vllm serve` (its docstring says how to run it).
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
import time
from typing import Any

import anyio
import pytest
import torch

from harness.testing import FakeGenerationServer
from harness.weight_sync.vllm_nccl import (
    VLLM_INSTALL_HINT,
    VllmNcclApi,
    VllmNcclGroup,
    VllmUnavailableError,
    check_vllm_layout,
    group_world_size,
    init_info,
    iter_packed_buckets,
    load_vllm_api,
    transfer_layout,
    unpack_bucket,
    update_info,
    worker_rank,
)
from harness.weight_sync.wire import (
    DEFAULT_BUFFER_SIZE_BYTES,
    WeightManifest,
    WeightTransferError,
    plan_buckets,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, odd byte sizes (so later tensors start at unaligned offsets), a 0-d and an
    empty tensor, a non-contiguous one, and float bit patterns that compare unequal to themselves (NaN)."""
    generator = torch.Generator().manual_seed(0)
    weird = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)
    return [
        ("mask", torch.tensor([True, False, True, True, False])),  # 5 bytes
        ("embed.weight", torch.randn(7, 3, generator=generator)),  # float32, at offset 5
        ("norm.weight", torch.randn(9, generator=generator).to(torch.bfloat16)),
        ("scale", torch.tensor(3.5, dtype=torch.float16)),  # 0-d
        ("ids", torch.randint(-(2**40), 2**40, (2, 3), generator=generator)),  # int64
        ("empty", torch.empty(0, 4)),
        ("bytes", torch.randint(0, 256, (3,), generator=generator, dtype=torch.int64).to(torch.uint8)),
        ("transposed", torch.randn(4, 6, generator=generator).t()),  # non-contiguous
        ("special", weird),
        ("double", torch.randn(2, 2, 2, generator=generator, dtype=torch.float64)),
        ("half", torch.randn(11, generator=generator).to(torch.float16)),
    ]


def aligned_tensors() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes that vLLM's receiver can unpack: every size a multiple of 8 bytes, so each
    tensor starts aligned in any bucket; no 0-d tensor. Also empty, non-contiguous and NaN payloads."""
    generator = torch.Generator().manual_seed(1)
    return [
        ("mask", torch.tensor([True, False, True, True, False, False, True, True])),
        ("embed.weight", torch.randn(7, 2, generator=generator)),
        ("norm.weight", torch.randn(12, generator=generator).to(torch.bfloat16)),
        ("ids", torch.randint(-(2**40), 2**40, (2, 3), generator=generator)),
        ("empty", torch.empty(0, 4)),
        ("bytes", torch.randint(0, 256, (16,), generator=generator, dtype=torch.int64).to(torch.uint8)),
        ("transposed", torch.randn(4, 6, generator=generator).t()),
        ("special", torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)),
        ("double", torch.randn(2, 2, 2, generator=generator, dtype=torch.float64)),
        ("half", torch.randn(4, generator=generator).to(torch.float16)),
        ("signed", torch.randint(-128, 128, (8,), generator=generator, dtype=torch.int64).to(torch.int8)),
    ]


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().view(-1).view(torch.uint8).tolist())


def vllm_receiver_buckets(manifest: WeightManifest, buffer_size_bytes: int) -> list[list[int]]:
    """vLLM's consumer rule, from the manifest alone: add each tensor's bytes; a bucket closes once its
    size exceeds the buffer size; whatever is left at the end is one more bucket."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, (dtype_name, shape) in enumerate(zip(manifest.dtype_names, manifest.shapes, strict=True)):
        current.append(index)
        size += math.prod(shape) * getattr(torch, dtype_name).itemsize
        if size > buffer_size_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def vllm_unpack(packed: torch.Tensor, manifest: WeightManifest, indices: list[int]) -> list[torch.Tensor]:
    """vLLM's `unpack_tensor`, verbatim in effect: split, `.contiguous().view(dtype).view(*shape)`."""
    sizes = [
        math.prod(manifest.shapes[i]) * getattr(torch, manifest.dtype_names[i]).itemsize for i in indices
    ]
    return [
        piece.contiguous().view(getattr(torch, manifest.dtype_names[i])).view(*manifest.shapes[i])
        for i, piece in zip(indices, packed.split(sizes), strict=True)
    ]


BUFFER_SIZES = [1, 8, 37, 64, 100, 10_000, DEFAULT_BUFFER_SIZE_BYTES]


# ------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
@pytest.mark.parametrize("tensors", [aligned_tensors, mixed_tensors])
def test_packed_buckets_follow_plan_buckets_and_unpack_bit_exactly(tensors, buffer_size: int) -> None:
    named = tensors()
    manifest = WeightManifest.of(named)
    planned = plan_buckets(manifest, buffer_size)
    packed = list(iter_packed_buckets(manifest, iter(named), buffer_size))

    assert [bucket for bucket, _ in packed] == planned
    assert [list(bucket) for bucket in planned] == vllm_receiver_buckets(manifest, buffer_size)
    vllm_can_unpack = tensors is aligned_tensors
    for bucket, data in packed:
        assert data.dtype == torch.uint8 and data.dim() == 1
        assert data.numel() == sum(manifest.nbytes(i) for i in bucket)
        ours = unpack_bucket(data, manifest, bucket)
        for index, (name, tensor) in zip(bucket, ours, strict=True):
            original = named[index][1]
            assert name == manifest.names[index]
            assert tensor.dtype == original.dtype and tensor.shape == original.shape
            assert raw_bytes(tensor) == raw_bytes(original), name
        if vllm_can_unpack:
            theirs = vllm_unpack(data, manifest, list(bucket))
            assert [raw_bytes(t) for t in theirs] == [raw_bytes(t) for _, t in ours]
    joined = b"".join(bytes(data.tolist()) for _, data in packed)
    assert joined == b"".join(raw_bytes(t) for _, t in named)


def test_layouts_vllm_cannot_unpack_are_refused_before_sending() -> None:
    aligned = WeightManifest.of(aligned_tensors())
    for buffer_size in BUFFER_SIZES:
        check_vllm_layout(aligned, buffer_size)
    # A float32 after 5 bytes of bool: vLLM's view(float32) of a slice at offset 5 raises in torch.
    misaligned = WeightManifest.of([("mask", torch.zeros(5, dtype=torch.bool)), ("w", torch.zeros(3))])
    packed = next(
        iter_packed_buckets(
            misaligned, [("mask", torch.zeros(5, dtype=torch.bool)), ("w", torch.zeros(3))], 1000
        )
    )[1]
    with pytest.raises(RuntimeError, match="divisible"):
        vllm_unpack(packed, misaligned, [0, 1])
    with pytest.raises(WeightTransferError, match="starts at byte 5"):
        check_vllm_layout(misaligned, 1000)
    check_vllm_layout(misaligned, 1)  # 5 bytes > 1: the float32 opens a bucket of its own
    scalar = WeightManifest.of([("scale", torch.tensor(1.0))])
    with pytest.raises(WeightTransferError, match="0-d"):
        update_info(scalar)
    communicator = RecordingCommunicator()
    group = VllmNcclGroup(communicator, None, rank=0, world_size=2, device="cpu")
    with pytest.raises(WeightTransferError, match="cannot unpack"):
        group.send(mixed_tensors(), 1000)
    assert communicator.sent == []


def test_packing_rejects_tensors_that_do_not_match_the_manifest() -> None:
    named = mixed_tensors()
    manifest = WeightManifest.of(named)
    wrong_dtype = [*named[:2], ("norm.weight", named[2][1].float()), *named[3:]]
    with pytest.raises(WeightTransferError, match=r"norm\.weight"):
        list(iter_packed_buckets(manifest, wrong_dtype, 10_000))
    with pytest.raises(WeightTransferError, match="manifest lists"):
        list(iter_packed_buckets(manifest, named[:-1], 10_000))
    with pytest.raises(WeightTransferError, match="more tensors"):
        list(iter_packed_buckets(manifest, [*named, ("extra", torch.zeros(1))], 10_000))


# -------------------------------------------------------------------------------------- send (CPU)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []


class RecordingStream:
    """A stream stand-in that logs synchronize/wait_stream (no `cuda_stream`, so no CUDA context)."""

    def __init__(self, name: str, log: Log) -> None:
        self.name, self.log = name, log

    def synchronize(self) -> None:
        self.log.events.append(("sync", self.name))

    def wait_stream(self, other: Any) -> None:
        self.log.events.append(("wait", self.name))


class RecordingCommunicator:
    def __init__(self, log: Log | None = None) -> None:
        self.log = log or Log()
        self.sent: list[tuple[torch.Tensor, torch.Tensor, int, Any]] = []  # (buffer, copy, src, stream)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.sent.append((tensor, tensor.clone(), src, stream))
        self.log.events.append(("broadcast", getattr(stream, "name", "?")))


def test_send_broadcasts_each_bucket_from_rank_0_alternating_two_streams() -> None:
    log = Log()
    streams = [RecordingStream("a", log), RecordingStream("b", log)]
    communicator = RecordingCommunicator(log)
    group = VllmNcclGroup(communicator, None, rank=0, world_size=3, device="cpu", streams=streams)
    named = aligned_tensors()
    manifest = group.send(named, 37)

    assert manifest == WeightManifest.of(named)
    planned = plan_buckets(manifest, 37)
    assert len(communicator.sent) == len(planned) > 2
    for (buffer, copy, src, stream), bucket, slot in zip(
        communicator.sent, planned, range(len(planned)), strict=True
    ):
        assert src == 0
        assert stream is streams[slot % 2]
        assert buffer.dtype == torch.uint8 and buffer.numel() == sum(manifest.nbytes(i) for i in bucket)
        # The buffer handed to NCCL is not reused or overwritten by later buckets.
        assert torch.equal(buffer, copy)
        for index, tensor in zip(bucket, vllm_unpack(copy, manifest, list(bucket)), strict=True):
            assert raw_bytes(tensor) == raw_bytes(named[index][1])
    # Each slot waits for its previous broadcast before packing the next bucket into it, and packing
    # waits for the producer stream; everything is drained before send returns.
    events = log.events
    broadcasts = [i for i, event in enumerate(events) if event[0] == "broadcast"]
    for position, at in enumerate(broadcasts):
        name = events[at][1]
        before = events[broadcasts[position - 2] if position >= 2 else 0 : at]
        assert ("sync", name) in before and ("wait", name) in before
    assert {event for event in events[broadcasts[-1] + 1 :]} >= {("sync", "a"), ("sync", "b")}


def test_send_with_a_manifest_pulls_one_bucket_at_a_time() -> None:
    named = aligned_tensors()
    manifest = WeightManifest.of(named)
    pulled: list[int] = []

    def lazily():  # like gathering FSDP shards one parameter at a time
        for index, item in enumerate(named):
            pulled.append(index)
            yield item

    pulled_at_broadcast: list[int] = []

    class Communicator(RecordingCommunicator):
        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            pulled_at_broadcast.append(len(pulled))
            super().broadcast(tensor, src, stream)

    group = VllmNcclGroup(Communicator(), None, rank=0, world_size=2, device="cpu")
    assert group.send(lazily(), 37, manifest=manifest) is manifest
    assert pulled_at_broadcast == [bucket.stop for bucket in plan_buckets(manifest, 37)]


def test_send_rejects_a_mismatch_and_a_closed_group() -> None:
    named = aligned_tensors()
    manifest = WeightManifest.of(named)
    communicator = RecordingCommunicator()
    group = VllmNcclGroup(communicator, None, rank=0, world_size=2, device="cpu")
    swapped = [named[1], named[0], *named[2:]]
    with pytest.raises(WeightTransferError, match="manifest says"):
        group.send(swapped, 10_000, manifest=manifest)
    assert communicator.sent == []  # nothing of the bad bucket went out
    group.close()
    group.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        group.send(named)


def test_http_bodies_carry_exactly_what_vllm_parses() -> None:
    assert init_info("10.0.0.5", 29500, 5) == {
        "master_address": "10.0.0.5",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 5,
    }
    manifest = WeightManifest.of(aligned_tensors())
    info = update_info(manifest)
    assert info == {**manifest.to_update_info(), "packed": True}
    assert all(not name.startswith("torch.") for name in info["dtype_names"])
    assert update_info(manifest, 1 << 20)["packed_buffer_size_bytes"] == 1 << 20


def test_ranks_and_world_size_follow_the_protocol() -> None:
    # A server of DP 2 x (TP 2 x PP 2) reports 8 from /get_world_size; the group holds 9 ranks.
    dp, per_dp = 2, 4
    assert group_world_size(dp * per_dp) == 9
    ranks = [worker_rank(d, r, per_dp) for d in range(dp) for r in range(per_dp)]
    assert sorted(ranks) == list(range(1, 9))  # every worker distinct, none is the trainer's 0
    with pytest.raises(ValueError):
        group_world_size(0)


# ------------------------------------------------------------------------------------ missing vLLM


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_every_entry_point_names_the_fix() -> None:
    hint = VLLM_INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")
    assert VLLM_INSTALL_HINT == 'pip install "agent-harness[vllm]"'
    with pytest.raises(VllmUnavailableError, match=hint):
        load_vllm_api()
    with pytest.raises(VllmUnavailableError, match=hint):
        VllmNcclGroup.connect(master_address="127.0.0.1", master_port=1, world_size=2, device="cpu")
    server = fake_server(world_size=1)
    with pytest.raises(ImportError, match=hint):
        anyio.run(lambda: VllmNcclGroup.connect_server(server, master_address="127.0.0.1", master_port=1))
    assert server.calls == []  # failed before touching the server


# ----------------------------------------------------------------------------- connect choreography


def fake_server(
    world_size: int,
    rendezvous_started: threading.Event | None = None,
    fail: Exception | None = None,
    hang: bool = False,
) -> FakeGenerationServer:
    """The shared fake server, whose /init_weight_transfer_engine waits until the trainer's rendezvous has
    started (as vLLM's workers wait for the trainer's store), so a connect that ran the two one after the
    other would deadlock; `workers_joined` is set once it answers."""
    server = FakeGenerationServer(world_size=world_size)
    server.workers_joined = threading.Event()  # type: ignore[attr-defined]

    async def init(body: dict[str, Any]) -> None:
        if fail is not None:
            raise fail
        if hang:
            await anyio.sleep(3600)
        if rendezvous_started is not None:
            while not rendezvous_started.is_set():
                await anyio.sleep(0.005)
        server.workers_joined.set()  # type: ignore[attr-defined]

    server.before("init_weight_transfer_engine", init)
    return server


def fake_vllm(
    server: FakeGenerationServer | None,
    started: threading.Event,
    release: threading.Event,
    create_error: Exception | None = None,
    disabled: bool = False,
):
    """StatelessProcessGroup.create blocks until the server's workers joined (or `release`)."""
    record: dict[str, Any] = {}

    class StatelessProcessGroup:
        @staticmethod
        def create(host: str, port: int, rank: int, world_size: int, store_timeout: int = 300):
            record["create"] = {
                "host": host,
                "port": port,
                "rank": rank,
                "world_size": world_size,
                "store_timeout": store_timeout,
            }
            started.set()
            if create_error is not None:
                raise create_error
            while not release.is_set() and not (server is not None and server.workers_joined.is_set()):
                time.sleep(0.005)
            return ("group", rank, world_size)

    class Communicator:
        def __init__(self, group: Any, device: Any) -> None:
            record["communicator"] = {"group": group, "device": device}
            self.disabled = disabled

        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            pass

    return VllmNcclApi(stateless_process_group=StatelessProcessGroup, communicator=Communicator), record


def connect(server: FakeGenerationServer, api: VllmNcclApi, timeout_s: float = 10.0) -> VllmNcclGroup:
    async def main() -> VllmNcclGroup:
        return await VllmNcclGroup.connect_server(
            server, master_address="10.1.2.3", master_port=29501, device="cpu", timeout_s=timeout_s, vllm=api
        )

    return anyio.run(main)


def test_connect_runs_the_http_call_and_the_rendezvous_together() -> None:
    started, release = threading.Event(), threading.Event()
    server = fake_server(world_size=4, rendezvous_started=started)
    api, record = fake_vllm(server, started, release)
    try:
        group = connect(server, api)
    finally:
        release.set()
    assert [route for route, _ in server.calls] == ["/init_weight_transfer_engine"]
    assert server.calls[0][1]["init_info"] == {
        "master_address": "10.1.2.3",
        "master_port": 29501,
        "rank_offset": 1,
        "world_size": 5,
    }
    assert record["create"] == {
        "host": "10.1.2.3",
        "port": 29501,
        "rank": 0,
        "world_size": 5,
        "store_timeout": 10,
    }
    assert record["communicator"] == {"group": ("group", 0, 5), "device": torch.device("cpu")}
    assert (group.rank, group.world_size, group.device) == (0, 5, torch.device("cpu"))
    group.close()


def test_a_failing_http_call_raises_instead_of_hanging() -> None:
    started, release = threading.Event(), threading.Event()
    server = fake_server(world_size=2, fail=RuntimeError("400: Invalid init_info"))
    api, _ = fake_vllm(None, started, release)  # the rendezvous never completes on its own
    begin = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="Invalid init_info"):
            connect(server, api, timeout_s=30.0)
    finally:
        release.set()
    assert time.monotonic() - begin < 5.0


def test_a_failing_rendezvous_raises_while_the_http_call_hangs() -> None:
    started, release = threading.Event(), threading.Event()
    server = fake_server(world_size=2, hang=True)
    api, _ = fake_vllm(server, started, release, create_error=OSError("address already in use"))
    begin = time.monotonic()
    with pytest.raises(OSError, match="address already in use"):
        connect(server, api, timeout_s=30.0)
    assert time.monotonic() - begin < 5.0


def test_connect_gives_up_after_its_timeout() -> None:
    started, release = threading.Event(), threading.Event()
    server = fake_server(world_size=2, hang=True)
    api, _ = fake_vllm(None, started, release)
    begin = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="init_weight_transfer_engine and the rendezvous"):
            connect(server, api, timeout_s=0.3)
    finally:
        release.set()
    assert time.monotonic() - begin < 5.0


def test_connect_refuses_a_disabled_communicator_and_other_ranks() -> None:
    started, release = threading.Event(), threading.Event()
    release.set()
    api, _ = fake_vllm(None, started, release, disabled=True)
    with pytest.raises(RuntimeError, match="disabled"):
        VllmNcclGroup.connect(master_address="h", master_port=1, world_size=2, device="cpu", vllm=api)
    with pytest.raises(ValueError, match="rank 0"):
        VllmNcclGroup.connect(master_address="h", master_port=1, rank=1, world_size=2, device="cpu", vllm=api)
    with pytest.raises(ValueError, match="NCCL only"):
        VllmNcclGroup.connect(
            master_address="h", master_port=1, world_size=2, backend="gloo", device="cpu", vllm=api
        )


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_send_on_cuda_streams_delivers_every_byte() -> None:
    """The CUDA path of `send` (two streams, wait_stream, record_stream) with a communicator that copies
    what it is handed on the stream it is given, as an NCCL broadcast would read it."""

    class CopyingCommunicator:
        def __init__(self) -> None:
            self.received: list[torch.Tensor] = []

        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            assert src == 0 and stream is not None and tensor.is_cuda
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1_000_000)  # a slow "send": overwriting the buffer early would show
                self.received.append(tensor.clone())

    device = torch.device("cuda", torch.cuda.current_device())
    named = [(name, tensor.to(device)) for name, tensor in aligned_tensors()]
    named += [(f"big.{i}", torch.randn(1000, 257, device=device)) for i in range(6)]
    communicator = CopyingCommunicator()
    group = VllmNcclGroup(communicator, None, rank=0, world_size=2, device=device)
    manifest = group.send(named, 300_000)
    torch.cuda.synchronize()
    planned = plan_buckets(manifest, 300_000)
    assert len(communicator.received) == len(planned) > 2
    for data, bucket in zip(communicator.received, planned, strict=True):
        for index, tensor in zip(bucket, vllm_unpack(data.cpu(), manifest, list(bucket)), strict=True):
            assert raw_bytes(tensor) == raw_bytes(named[index][1].cpu()), manifest.names[index]
    group.close()


class TorchNcclCommunicator:
    """PyNcclCommunicator's `broadcast(tensor, src, stream)` over a torch.distributed NCCL group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        import torch.distributed as dist

        assert tensor.device == self.device
        with torch.cuda.stream(stream):
            dist.broadcast(tensor, src=src)


def sync_payload(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    named = [(name, tensor.to(device)) for name, tensor in aligned_tensors()]
    generator = torch.Generator(device=device).manual_seed(7)
    for i in range(8):
        named.append((f"layer.{i}.w", torch.randn(513, 97, generator=generator, device=device)))
        named.append((f"layer.{i}.b", torch.randn(97, device=device, generator=generator).to(torch.bfloat16)))
    return named


def _nccl_rank(rank: int, port: int, buffer_size: int) -> None:
    """One process of the 2-GPU test: rank 0 sends through VllmNcclGroup; rank 1 receives with vLLM's
    consumer loop (transcribed: two streams, a bucket per manifest rule, split + view) and compares."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        named = sync_payload(device)
        manifest = WeightManifest.of(named)
        communicator = TorchNcclCommunicator(device)
        if rank == 0:
            group = VllmNcclGroup(communicator, None, rank=0, world_size=2, device=device)
            for _ in range(2):  # twice: the streams are reused across sends
                group.send(named, buffer_size)
            torch.cuda.synchronize()
            return
        streams = [torch.cuda.Stream(device=device) for _ in range(2)]
        for _ in range(2):
            received: list[torch.Tensor] = []
            for slot, indices in enumerate(vllm_receiver_buckets(manifest, buffer_size)):
                stream = streams[slot % 2]
                stream.synchronize()
                with torch.cuda.stream(stream):
                    size = sum(manifest.nbytes(i) for i in indices)
                    packed = torch.empty(size, dtype=torch.uint8, device=device)
                    communicator.broadcast(packed, src=0, stream=stream)
                    received += [t.cpu() for t in vllm_unpack(packed, manifest, indices)]
            torch.cuda.synchronize()
            assert len(received) == len(named)
            for (name, original), tensor in zip(named, received, strict=True):
                assert raw_bytes(tensor) == raw_bytes(original.cpu()), name
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_send_to_a_vllm_style_receiver_over_real_nccl() -> None:
    """Real NCCL between two GPUs (torch.distributed standing in for pynccl): every byte arrives."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_nccl_rank, args=(port, 200_000), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason=f"needs vLLM ({VLLM_INSTALL_HINT})")
@pytest.mark.skipif(not os.environ.get("VLLM_URL"), reason="needs VLLM_URL pointing at a running vllm serve")
def test_full_sync_against_vllm_serve() -> None:
    """The whole path against a real server: connect, pause, start, send + /update_weights, finish, resume.

    Run (two GPUs: the server on one, the trainer on the other; the model must be in the local HF cache):

        CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-0.6B --port 8000 \\
            --weight-transfer-config '{"backend": "nccl"}' &
        CUDA_VISIBLE_DEVICES=0 VLLM_URL=http://localhost:8000 VLLM_MASTER_ADDRESS=127.0.0.1 \\
            pytest tests/test_vllm_nccl.py -m gpu -k vllm_serve

    It sends the checkpoint's own weights (greedy output must not change), then the same weights with
    the final norm zeroed (greedy output must change), so a transfer that moved nothing or garbage fails.
    """
    from transformers import AutoModelForCausalLM

    from harness.generation.client import GenerationClient
    from harness.generation.protocol import SamplingConfig

    url = os.environ["VLLM_URL"]
    address = os.environ.get("VLLM_MASTER_ADDRESS", "127.0.0.1")
    port = int(os.environ.get("VLLM_MASTER_PORT", "29555"))

    async def sync(
        client: GenerationClient, group: VllmNcclGroup, named: list[tuple[str, Any]], layout: Any
    ) -> None:
        manifest = WeightManifest.of(named)
        await client.pause("keep")
        await client.start_weight_update()
        sender = threading.Thread(target=group.send, args=(named,), daemon=True)
        sender.start()
        await client.send_weight_manifest(update_info(manifest, layout=layout))
        await anyio.to_thread.run_sync(sender.join)
        await client.finish_weight_update()
        await client.resume()

    async def main() -> None:
        async with GenerationClient(url, timeout_s=600) as client:
            await client.wait_until_ready()
            model_id = (await client.model_info()).id
            model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16).cuda()
            named = list(model.named_parameters())
            layout = transfer_layout(await client.server_version())
            group = await VllmNcclGroup.connect_server(
                client, master_address=address, master_port=port, layout=layout
            )
            try:
                sampling = SamplingConfig(max_tokens=16, temperature=0.0)
                prompt = [1, 2, 3, 4, 5, 6, 7, 8]
                before = (await client.generate(prompt, sampling)).output_ids
                await sync(client, group, named, layout)
                assert (await client.generate(prompt, sampling)).output_ids == before
                with torch.no_grad():
                    model.model.norm.weight.zero_()
                await sync(client, group, list(model.named_parameters()), layout)
                assert (await client.generate(prompt, sampling)).output_ids != before
            finally:
                group.close()

    anyio.run(main)

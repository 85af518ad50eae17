"""Transports for merged weights: how MergedWeightSync's stream of (name, tensor) reaches the server.

    FileTransfer        one file in /dev/shm that the built-in server on this host reads
    IpcTransfer         a CUDA buffer of the trainer's that the built-in server on this host opens through
                        CUDA IPC (both on GPUs): two device copies, no file, no process group
    BroadcastTransfer   a process group the server joined (trainer = rank 0): torch.distributed for the
                        built-in server (NCCL on GPU, gloo on CPU), vLLM's own NCCL group for vLLM

Each has `send(server, model, weights)` (the start/manifest/finish requests of one sync, and the bytes)
and `close()`. Who talks to it: `MergedWeightSync` (strategies.py) calls send between pause and resume;
the receiving side is harness/server/ (the built-in server) or vLLM; what crosses is wire.py's format.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import queue
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch

    from harness.generation.client_thread import ClientThread
    from harness.generation.protocol import ServerControl
    from harness.weight_sync.wire import BroadcastGroup


logger = logging.getLogger(__name__)


class FileTransfer:
    """Merged weights through one file in /dev/shm (the built-in server on this host reads it).

    Streams: each tensor is written as it comes (`harness.weight_sync.wire.write_weights_file`), and the
    manifest, built on the way, is posted after.
    """

    kind = "file"

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = directory

    def send(
        self,
        server: ClientThread,
        model: Any,
        weights: Iterator[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
    ) -> None:
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


class IpcTransfer:
    """Merged weights through a CUDA buffer the built-in server on this host opens by its IPC handle
    (`harness.weight_sync.cuda_ipc`).

    The trainer keeps one buffer (at most `buffer_size_bytes`, at most the model's size), packs the tensors
    into it in manifest order, each at an aligned offset, and when it is full (or the weights end) posts
    /update_weights with that bucket's manifest, offsets and the buffer's handle; the server copies the
    bytes out before it answers, so the buffer is free for the next bucket. A 0.6B model in bf16 fits one
    2 GiB bucket: a sync is one request.
    """

    kind = "ipc"

    def __init__(self, *, device: torch.device | str = "cuda", buffer_size_bytes: int = 2 << 30) -> None:
        import torch

        self.device = torch.device(device)
        self.buffer_size_bytes = int(buffer_size_bytes)
        self._buffer: torch.Tensor | None = None

    def _buffer_for(self, model: Any, smallest: int, dtype: torch.dtype | None) -> torch.Tensor:
        import torch

        from harness.weight_sync.peft import sent_dtype, served_parameters

        if self._buffer is None or self._buffer.numel() < smallest:
            total = sum(
                _aligned(p.numel() * sent_dtype(p.dtype, dtype).itemsize) for _, p in served_parameters(model)
            )
            size = max(min(self.buffer_size_bytes, total), smallest)
            self._buffer = None  # the old one goes before the new one is taken
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._buffer

    def send(
        self,
        server: ClientThread,
        model: Any,
        weights: Iterator[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
    ) -> None:
        import torch

        from harness.weight_sync.cuda_ipc import share_buffer
        from harness.weight_sync.wire import WeightManifest

        server.call("start_weight_update")
        buffer = self._buffer_for(model, 0, dtype)
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        offsets: list[int] = []
        used = 0

        def flush() -> None:
            nonlocal used
            if not names:
                return
            torch.cuda.current_stream(buffer.device).synchronize()  # the bytes are there before it reads
            manifest = WeightManifest.of(list(zip(names, tensors, strict=True)))
            info = {**manifest.to_update_info(), "ipc": {"buffer": share_buffer(buffer), "offsets": offsets}}
            server.call("send_weight_manifest", info)
            names.clear()
            tensors.clear()
            offsets.clear()
            used = 0

        for name, tensor in weights:
            nbytes = tensor.numel() * tensor.element_size()
            if used + nbytes > buffer.numel():
                flush()
                if nbytes > buffer.numel():
                    buffer = self._buffer_for(model, _aligned(nbytes), dtype)
            view = buffer[used : used + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor, non_blocking=True)
            names.append(name)
            tensors.append(view)  # for the manifest's dtype and shape only
            offsets.append(used)
            used += _aligned(nbytes)
        flush()
        server.call("finish_weight_update")

    def close(self) -> None:
        self._buffer = None


def _aligned(nbytes: int) -> int:
    from harness.weight_sync.cuda_ipc import ALIGNMENT

    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class BroadcastTransfer:
    """Merged weights broadcast over a process group the server joined (trainer = rank 0).

    The group: for the built-in server a torch.distributed one (`harness.weight_sync.wire.BroadcastGroup`);
    for a vLLM server `harness.weight_sync.vllm_nccl.VllmNcclGroup` (vLLM's stateless group and pynccl;
    `vllm_api`: fake vLLM classes for tests), whose /init_weight_transfer_engine and /update_weights bodies
    carry only the keys vLLM accepts. Either way `connect` runs the trainer's rendezvous and
    /init_weight_transfer_engine at the same time, as each waits for the other. Per sync: the manifest is
    derived from the parameters' metadata (no tensor gathered), /update_weights carries it on the client's
    loop thread while this thread takes the tensors from the stream one by one (under FSDP2 rank 0 receives
    them gathered in buckets, harness/weight_sync/gather.py) and hands each closed bucket to a sender
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
        deltas: bool = False,
    ) -> None:
        import torch

        from harness.weight_sync.deltas import DeltaEncoder
        from harness.weight_sync.wire import DEFAULT_BUFFER_SIZE_BYTES

        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.buffer_size_bytes = buffer_size_bytes or DEFAULT_BUFFER_SIZE_BYTES
        self.vllm_api = vllm_api
        self.group: Any = None
        self.vllm = False
        self.layout: Any = None  # a vLLM server's TransferLayout
        # Deltas (harness/weight_sync/deltas.py), to the built-in server only: what was sent, and the token
        # of the weights the server holds after the last sync that completed (None: send them whole).
        self.encoder = DeltaEncoder() if deltas else None
        self.weights_token: str | None = None
        self.last_sent_bytes: int | None = None  # what the last sync broadcast (built-in server)

    @property
    def keeps_weights_on_failure(self) -> bool:
        """Whether the server still serves its old weights after a transfer that failed midway: the
        built-in server checks a manifest before it copies anything; vLLM swaps its weights out at
        /start_weight_update, so after a failure it must be restarted, never resumed."""
        return not self.vllm

    def connect(self, server: ClientThread, base_url: str) -> None:
        from harness.weight_sync.vllm_nccl import VllmNcclGroup, load_vllm_api

        builtin = str(server.server_info().get("server", "")).startswith("agent-harness")
        address = _address_towards(base_url)
        port = _free_port(address)
        endpoint = server.client
        if builtin:
            self.group = server.run(self._connect_builtin, endpoint, address, port, server.timeout_s)
            return
        self.vllm = True  # VllmUnavailableError (an ImportError naming the fix) when vLLM is not installed
        if self.encoder is not None:
            logger.info("weight_sync_deltas: not used, vLLM's receiving side takes whole tensors only")
            self.encoder = None
        api = self.vllm_api if self.vllm_api is not None else load_vllm_api()  # before touching the server
        self.layout = _vllm_layout(server)
        self.group = server.run(
            VllmNcclGroup.connect_server,
            endpoint,
            master_address=address,
            master_port=port,
            device=self.device,
            timeout_s=server.timeout_s,
            vllm=api,
            layout=self.layout,
            buffer_size_bytes=self.buffer_size_bytes,
        )

    async def _connect_builtin(
        self, endpoint: ServerControl, master_address: str, master_port: int, timeout_s: float
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

    def send(
        self,
        server: ClientThread,
        model: Any,
        weights: Iterator[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
    ) -> None:
        from harness.generation.protocol import ServerRequestError

        if self.group is None:
            raise RuntimeError("the broadcast group is not connected")
        manifest = merged_manifest(model, dtype)
        encoding: dict[str, Any] = {}
        sent_before = 0
        if self.vllm:
            from harness.weight_sync.vllm_nccl import update_info

            info = update_info(manifest, self.buffer_size_bytes, layout=self.layout)  # only keys vLLM takes
        else:
            info = {**manifest.to_update_info(), "packed": True, "buffer_size_bytes": self.buffer_size_bytes}
            if self.encoder is not None:
                as_delta = self.weights_token is not None and self.encoder.remembers(manifest.names)
                info["token"] = uuid.uuid4().hex
                if as_delta:
                    info["delta_base"] = self.weights_token
                encoding = {"encoder": self.encoder, "as_delta": as_delta}
            sent_before = self.group.bytes_sent
        self.weights_token = None  # until this sync has completed
        server.call("start_weight_update")
        try:
            self._broadcast(server, manifest, info, weights, encoding)
        except ServerRequestError as exc:
            if exc.status != 409 or self.encoder is None:
                raise
            # The server no longer holds the weights the delta was computed against (it restarted, or an
            # update failed): it drained the broadcast; the encoder now holds every new tensor: send those.
            info = {key: value for key, value in info.items() if key != "delta_base"}
            info["token"] = uuid.uuid4().hex
            remembered = iter(self.encoder.remembered(manifest.names))
            self._broadcast(server, manifest, info, remembered, {})
        if not self.vllm:
            self.last_sent_bytes = self.group.bytes_sent - sent_before
            self.weights_token = info.get("token")
        server.call("finish_weight_update")

    def _broadcast(
        self,
        server: ClientThread,
        manifest: Any,
        info: dict[str, Any],
        weights: Iterator[tuple[str, torch.Tensor]],
        encoding: dict[str, Any],
    ) -> None:
        """Post /update_weights with `info` while this thread hands the tensors over, bucket by bucket, to a
        sender thread that broadcasts them (with `encoding`'s keywords); raises the first failure of
        either."""
        from harness.weight_sync.wire import WeightTransferError, plan_buckets

        http = server.start("send_weight_manifest", info)
        buckets: queue.Queue = queue.Queue(maxsize=1)
        errors: list[BaseException] = []

        def send_buckets() -> None:
            try:
                while (bucket := buckets.get()) is not None:
                    self.group.send(bucket, self.buffer_size_bytes, **encoding)
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

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()


def merged_manifest(model: Any, dtype: torch.dtype | None = None) -> Any:
    """The WeightManifest `merged_named_parameters(model, dtype=dtype)` will yield, from metadata alone (no
    gathering)."""
    from harness.weight_sync.peft import sent_dtype, served_parameters
    from harness.weight_sync.wire import WeightManifest

    names, dtypes, shapes = [], [], []
    for name, parameter in served_parameters(model):
        names.append(name)
        dtypes.append(str(sent_dtype(parameter.dtype, dtype)).removeprefix("torch."))
        shapes.append(list(parameter.shape))  # a DTensor's shape is the global one
    return WeightManifest(names, dtypes, shapes)


def _vllm_layout(server: ClientThread) -> Any:
    """A vLLM server's transfer layout, checked before anything is sent: its version, and that it has the
    NCCL weight-transfer engine at all."""
    from harness.weight_sync.vllm_nccl import transfer_layout

    config = (server.server_info().get("vllm_config") or {}).get("weight_transfer_config")
    backend = config.get("backend") if isinstance(config, dict) else None
    if backend != "nccl":
        raise ValueError(
            f"the vLLM server has no NCCL weight-transfer engine (weight_transfer_config: {config!r}): start "
            'it with --weight-transfer-config \'{"backend": "nccl"}\' for merged weight sync'
        )
    return transfer_layout(server.call("server_version"))


def is_local_url(url: str) -> bool:
    """Whether the URL's host is this machine (loopback, or this host's own name)."""
    host = urlparse(url if "//" in url else f"http://{url}").hostname or ""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host in ("localhost", socket.gethostname()) or host == socket.getfqdn()


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


__all__ = ["BroadcastTransfer", "FileTransfer", "is_local_url", "merged_manifest"]

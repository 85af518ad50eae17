"""Benchmark: merged weight sync to the built-in server on the same GPU, shared-memory file against CUDA IPC.

    python benchmarks/bench_weight_sync.py --presets qwen3-0.6b qwen3-1.7b --syncs 4 --out ws.json

A random model of each preset's shape (Qwen's 151,936-token vocabulary, tied embeddings, bf16) is saved,
served by `harness serve` on cuda:0, and loaded by this process on cuda:0 as the trainer's copy; then
`--syncs` merged syncs through each transport (`MergedWeightSync`, as the trainer runs it: pause, send,
resume). Printed per preset and transport: the median of perf/weight_sync_s and of its parts (pause,
transfer), and the first sync's time (it allocates the IPC buffer). After each transport's syncs the
largest gap between the server's log-probs on a greedy completion and the trainer's own forward is printed:
it must be the same for both transports (bf16 noise between two forwards, about 1e-2 to 6e-2 here), else
a transport lost or garbled weights. tests/test_server_gpu.py checks the IPC path's exactness in float32.

H200 figures: benchmarks/results/bench_weight_sync_h200_qwen3.json.

`--gather`: the FSDP2 side alone, without a server, in two processes (gloo on CPU, or NCCL on two GPUs):

    python benchmarks/bench_weight_sync.py --gather                    # CPU, gloo, the "small" shape
    python benchmarks/bench_weight_sync.py --gather --device cuda --preset qwen3-0.6b   # 2 GPUs, NCCL

Each rank builds the same random bf16 Qwen3 of the chosen shape, upcasts it to float32 master weights as
the trainer does under bf16 mixed precision, and rank 0 first reads it unsharded (one process: the
reference); then it is sharded with FSDP2 (harness/training/fsdp.py) and read by
`merged_named_parameters` one parameter at a time (`DTensor.full_tensor()` on every rank) and in buckets
(gathered to rank 0, and all-gathered; and to rank 0 cast to bf16 first, as a sync to a bf16 server sends
them, beside one process casting them). Each way is timed twice over: reading the tensors alone ("gather"),
and writing them into a shared-memory file as FileTransfer does ("file", rank 0 writes, the others gather).
Printed per way: rank 0's median over `--repeats` runs after one warm-up, the collectives one run issues,
and each rank's peak memory growth during the runs (CPU: the peak resident size, reset before each way
through /proc/self/clear_refs; GPU: torch.cuda.max_memory_allocated). The warm-up's tensors are checked
bit-identical to the reference. "small" is Qwen3-0.6B's layout (28 layers: 310 served tensors, so as many
collectives one at a time) at a quarter of its width and a 32,768-token vocabulary (122 MB of float32).

Figures on a 2-core CPU machine shared with other work (so only the ratios between the ways mean much):
benchmarks/results/bench_weight_sync_2core_gather_{256,16}mib.json (`--bucket-mib 256` and `16`,
`--repeats 5`; before the bf16 ways existed) and bench_weight_sync_2core_gather_bf16.json (`--repeats 3`).
Not run on two GPUs: no two-GPU machine was lent when this mode was written, so its NCCL
path has never run and no GPU figures exist.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

# Qwen3-0.6B's layout at a quarter of its width: as many tensors (collectives one at a time), 1/20 the bytes
SMALL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 28,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
SMALL_VOCAB_SIZE = 32768


def build(preset: str, directory: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from harness.testing import build_tiny_tokenizer
    from harness.testing.models import QWEN3_SHAPES, QWEN_VOCAB_SIZE

    config = Qwen3Config(
        vocab_size=QWEN_VOCAB_SIZE,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        **QWEN3_SHAPES[preset],
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)


def check_served(url: str, model: torch.nn.Module) -> float:
    """The largest gap between the server's and the model's log-probs on a greedy completion."""
    import anyio

    from harness.generation.client import GenerationClient
    from harness.generation.protocol import SamplingConfig

    prompt = list(range(100, 140))

    async def main():
        async with GenerationClient(url, timeout_s=120) as client:
            return await client.generate(
                prompt, SamplingConfig(max_tokens=8, temperature=0.0, num_logprobs=0)
            )

    completion = anyio.run(main)
    tokens = torch.tensor([prompt + completion.output_ids], device="cuda")
    with torch.no_grad():
        logprobs = model(tokens).logits[0].float().log_softmax(-1)
    return max(
        abs(completion.output_log_probs[j] - logprobs[len(prompt) - 1 + j, t].item())
        for j, t in enumerate(completion.output_ids)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"])
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--gather", action="store_true", help="the FSDP2 gather in two processes (docstring)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--gather: gloo or NCCL")
    parser.add_argument("--preset", default="small", help="--gather: 'small' or a QWEN3_SHAPES preset")
    parser.add_argument("--bucket-mib", type=int, default=256, help="--gather: the bucket size")
    parser.add_argument("--repeats", type=int, default=3, help="--gather: timed runs per way")
    args = parser.parse_args()
    if args.gather:
        gather_main(args)
        return

    from transformers import AutoModelForCausalLM

    from harness.generation.client_thread import ClientThread
    from harness.server.launch import start_builtin_server
    from harness.weight_sync.strategies import MergedWeightSync
    from harness.weight_sync.transports import FileTransfer, IpcTransfer

    results: dict[str, dict] = {}
    for preset in args.presets:
        directory = Path(tempfile.mkdtemp(prefix=f"bench-ws-{preset}-"))
        build(preset, directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to("cuda").eval()
        size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
        with (
            start_builtin_server(directory, device="cuda", dtype="bfloat16", max_model_len=1024) as server,
            ClientThread(server.base_url, 600.0) as client,
        ):
            for name, transfer in (("file", FileTransfer()), ("ipc", IpcTransfer(device="cuda"))):
                sync = MergedWeightSync(transfer, client)
                runs = []
                for version in range(1, args.syncs + 1):
                    with torch.no_grad():
                        model.model.norm.weight.mul_(1.01)  # something changes every sync
                    torch.cuda.synchronize()
                    runs.append(sync.sync(model, version))
                gap = check_served(server.base_url, model)
                sync.close()
                steady = runs[1:] or runs
                entry = {
                    key.removeprefix("perf/"): statistics.median(run[key] for run in steady)
                    for key in (
                        "perf/weight_sync_s",
                        "perf/weight_sync_pause_s",
                        "perf/weight_sync_transfer_s",
                    )
                }
                entry.update(first_sync_s=runs[0]["perf/weight_sync_s"], max_logprob_gap=gap, size_gb=size_gb)
                results[f"{preset} {name}"] = entry
                print(
                    f"{preset:11s} {name:4s} {size_gb:.2f} GB: sync {entry['weight_sync_s'] * 1e3:7.1f} ms "
                    f"(pause {entry['weight_sync_pause_s'] * 1e3:.1f}, transfer "
                    f"{entry['weight_sync_transfer_s'] * 1e3:.1f}), "
                    f"first {entry['first_sync_s'] * 1e3:.0f} ms, served gap {gap:.2e}",
                    flush=True,
                )
        del model
        torch.cuda.empty_cache()
        shutil.rmtree(directory, ignore_errors=True)  # a model of gigabytes per preset
        if args.out:  # after each preset, so a cut run keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=2))


# --- --gather: the FSDP2 side in two processes ------------------------------------------------------------


def gather_main(args: argparse.Namespace) -> None:
    """Run the two ranks (`gather_rank`), then print and save rank 0's figures."""
    from harness.testing.ranks import run_ranks

    settings = {"device": args.device, "preset": args.preset, "bucket_bytes": args.bucket_mib << 20}
    settings["repeats"] = args.repeats
    # CPU: every allocation from 1 MiB up is its own mapping, returned when freed, so the peak resident size
    # follows the buffers alive at once (glibc would otherwise keep freed ones and count them)
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)} if args.device == "cpu" else {}
    with tempfile.TemporaryDirectory(prefix="bench-gather-") as out_dir:
        run_ranks(
            [sys.executable, __file__, "--gather-rank"],
            Path(out_dir),
            world_size=2,
            extra_args=[out_dir, json.dumps(settings)],
            timeout_s=1800,
            env=env,
        )
        results = json.loads((Path(out_dir) / "results.json").read_text())
    print(
        f"{args.preset}, {results['size_mb']:.0f} MB of float32, {results['tensors']} tensors, 2 processes "
        f"({'NCCL' if args.device == 'cuda' else 'gloo'}), buckets of {args.bucket_mib} MiB; rank 0's median "
        f"of {args.repeats}:"
    )
    for way, entry in results["ways"].items():
        growth = ", ".join("-" if mb is None else f"{mb:.0f}" for mb in entry["peak_growth_mb"])
        print(
            f"  {way:34s} gather {entry['gather_s'] * 1e3:8.1f} ms   file {entry['file_s'] * 1e3:8.1f} ms   "
            f"{entry['collectives']:4d} collectives   peak growth per rank {growth} MB"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": settings, **results}, indent=2))


WAYS: dict[str, dict[str, Any]] = {  # the keyword arguments of merged_named_parameters on the sharded model
    "FSDP2 one at a time": {"bucket_size_bytes": None},
    "FSDP2 buckets, gather to rank 0": {},
    "FSDP2 buckets, all-gather": {"all_ranks": True},
    "FSDP2 buckets to rank 0, as bf16": {"dtype": torch.bfloat16},  # a bf16 server's weight sync
}
REFERENCE = "one process (reference)"
REFERENCE_BF16 = "one process, as bf16"


def gather_rank(rank: int, world: int, port: int, out_dir: str, settings: dict[str, Any]) -> None:
    """One rank: build, time the reference on rank 0, shard, time each way; rank 0 writes results.json."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from harness.testing.models import QWEN3_SHAPES, QWEN_VOCAB_SIZE
    from harness.training.fsdp import mixed_precision_policy, shard_model, use_float32_master_weights
    from harness.training.processes import end_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(settings["device"], rank) if settings["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        small = settings["preset"] == "small"
        config = Qwen3Config(
            vocab_size=SMALL_VOCAB_SIZE if small else QWEN_VOCAB_SIZE,
            tie_word_embeddings=True,
            **(SMALL_SHAPE if small else QWEN3_SHAPES[settings["preset"]]),
        )
        torch.manual_seed(0)  # the same weights on every rank, as after loading a checkpoint
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).to(device)
        policy = mixed_precision_policy(bf16=True, fp16=False)
        use_float32_master_weights(model, policy)
        ways: dict[str, dict[str, Any]] = {}
        reference: dict[str, torch.Tensor] = {}
        if rank == 0:
            reference = {name: tensor.to("cpu", copy=True) for name, tensor in _weights(model, {})}
            ways[REFERENCE] = _time_way(model, {}, rank=rank, repeats=settings["repeats"], sharded=False)
            ways[REFERENCE]["collectives"] = 0
            bf16 = {"dtype": torch.bfloat16}
            ways[REFERENCE_BF16] = _time_way(
                model, bf16, rank=rank, repeats=settings["repeats"], sharded=False
            )
            ways[REFERENCE_BF16]["collectives"] = 0
        dist.barrier()
        shard_model(model, mp_policy=policy, mesh=init_device_mesh(device.type, (world,)))
        for way, kwargs in WAYS.items():
            kwargs = {"bucket_size_bytes": settings["bucket_bytes"], **kwargs}
            collectives = _check(model, kwargs, rank, reference)
            ways[way] = _time_way(model, kwargs, rank=rank, repeats=settings["repeats"], sharded=True)
            ways[way]["collectives"] = collectives
        growths: list[Any] = [None] * world
        dist.all_gather_object(growths, {way: entry["peak_growth_mb"] for way, entry in ways.items()})
        if rank == 0:
            for way, entry in ways.items():
                entry["peak_growth_mb"] = [growth.get(way) for growth in growths]
            results = {
                "size_mb": sum(t.numel() * t.element_size() for t in reference.values()) / 1e6,
                "tensors": len(reference),
                "ways": ways,
            }
            (Path(out_dir) / "results.json").write_text(json.dumps(results))
    finally:
        end_process_group()  # and gloo's workers idle before the interpreter exits


def _weights(model: Any, kwargs: dict[str, Any]) -> Any:
    from harness.weight_sync.peft import merged_named_parameters

    return merged_named_parameters(model, **kwargs)


def _check(model: Any, kwargs: dict[str, Any], rank: int, reference: dict[str, torch.Tensor]) -> int:
    """The warm-up: rank 0's tensors must be bit-identical to one process's (cast as the way casts them);
    the collectives it issued."""
    from harness.testing.collectives import CollectiveCounter

    if kwargs.get("dtype") is not None:
        reference = {name: tensor.to(kwargs["dtype"]) for name, tensor in reference.items()}
    with CollectiveCounter() as counter:
        got = {name: tensor.to("cpu", copy=True) for name, tensor in _weights(model, kwargs) if rank == 0}
    if rank == 0:
        different = [
            name for name in reference if name not in got or not torch.equal(got[name], reference[name])
        ]
        if different or len(got) != len(reference):
            raise AssertionError(
                f"{kwargs}: {len(different)} tensors differ from one process's: {different[:3]}"
            )
    return counter.count


def _time_way(
    model: Any, kwargs: dict[str, Any], *, rank: int, repeats: int, sharded: bool
) -> dict[str, Any]:
    """Timed runs of one way, reading the weights and writing them into a file, and the peak memory growth
    over the runs."""
    import torch.distributed as dist

    from harness.weight_sync.wire import default_weights_dir, write_weights_file

    path = default_weights_dir() / f"bench-gather-{uuid.uuid4().hex}.bin"
    timings: dict[str, list[float]] = {"gather": [], "file": []}
    before = _memory_now(model)
    _reset_peak(model)
    try:
        for _ in range(repeats):
            for sink in ("gather", "file"):
                if sharded:
                    dist.barrier()
                started = time.monotonic()
                weights = _weights(model, kwargs)
                if sink == "file" and rank == 0:
                    write_weights_file(weights, path)
                else:
                    for _ in weights:
                        pass
                _synchronize(model)
                timings[sink].append(time.monotonic() - started)
    finally:
        path.unlink(missing_ok=True)
    return {
        "gather_s": statistics.median(timings["gather"]),
        "file_s": statistics.median(timings["file"]),
        "peak_growth_mb": (_peak(model) - before) / 1e6,
    }


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _synchronize(model: Any) -> None:
    if _device(model).type == "cuda":
        torch.cuda.synchronize()


def _memory_now(model: Any) -> int:
    """Bytes held now: the GPU's allocated memory, or the process's resident size on the CPU (after glibc
    returned the memory it keeps from earlier frees, which later allocations would otherwise reuse unseen)."""
    if _device(model).type == "cuda":
        return torch.cuda.memory_allocated()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_kb("VmRSS") * 1024


def _reset_peak(model: Any) -> None:
    if _device(model).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak resident size restarts from now


def _peak(model: Any) -> int:
    if _device(model).type == "cuda":
        return torch.cuda.max_memory_allocated()
    return _status_kb("VmHWM") * 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (the CPU memory figures need Linux)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--gather-rank"]:  # one rank of --gather, started by gather_main
        rank, world, port, out_dir, settings = sys.argv[2:7]
        gather_rank(int(rank), int(world), int(port), out_dir, json.loads(settings))
    else:
        main()

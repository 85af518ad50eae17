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
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch


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
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()

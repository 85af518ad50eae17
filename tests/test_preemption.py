"""A run stopped from outside, end to end on CPU: SIGKILL mid-run and a resume lose no prompt; SIGTERM (what
Slurm and Kubernetes send before preemption) stops a run cleanly, with a checkpoint, and leaves nothing.

The runs are real `train()`s in subprocesses (tiny model, built-in server, spawned worker); the script below
records, as they happen, which prompt positions the trainer trains samples of and which it is done with.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NUM_PROMPTS = 48

RUN = r'''
import json, sys
from datasets import Dataset
from environments import Environment, Manifest
from harness import AsyncGRPOConfig, AsyncGRPOTrainer
from sandboxes.base import Limits, SandboxSpec

NUM_PROMPTS = int(sys.argv[5]) if len(sys.argv) > 5 else 24
BACKEND = sys.argv[6] if len(sys.argv) > 6 else "local"


def spread_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


class ShellEnv(Environment):
    """Each rollout holds a local sandbox, so a stop has sandboxes to close."""

    manifest = Manifest(name="shell", sandbox=SandboxSpec(backend=BACKEND, limits=Limits(memory_mb=256)),
                        sandbox_tools=("bash",), reward_names=())

    def reset(self, **row):
        return "Run something."


class Recording(AsyncGRPOTrainer):
    """Appends {"trained": position, "step": n} for every trained sample and {"done": position} for every
    prompt the ledger is done with, to the record file, as it happens."""

    def _setup_run(self, resume_from_checkpoint):
        super()._setup_run(resume_from_checkpoint)
        done = self.ledger._done

        def record_done(position):
            done(position)
            self._record({"done": position})

        self.ledger._done = record_done

    def _train_on_plan(self, plan_rows):
        out = super()._train_on_plan(plan_rows)
        for micro_batch in plan_rows["micro_batches"]:
            for row in micro_batch:
                for sample in row:
                    self._record({"trained": sample.position, "step": self.state.global_step + 1})
        return out

    def _record(self, entry):
        with open(RECORD, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


if __name__ == "__main__":
    mode, model_dir, out_dir, RECORD = sys.argv[1:5]
    args = AsyncGRPOConfig(
        output_dir=out_dir, max_steps=-1, num_generations=3, max_completion_length=6,
        max_concurrent_rollouts=6, max_staleness=2, gradient_checkpointing=False,
        learning_rate=1e-3, save_strategy="steps", save_steps=1 if mode != "sigterm" else 1000,
        token_budget=160 if mode != "sigterm" else 1200, num_train_epochs=1 if mode != "sigterm" else 100,
        report_to="none", generation_server="builtin", disable_tqdm=True, seed=7,
        max_tool_calling_iterations=1,
    )
    rows = [[{"role": "user", "content": f"count to {i}"}] for i in range(NUM_PROMPTS)]
    dataset = Dataset.from_dict({"prompt": rows})
    extra = {"environment_factory": ShellEnv} if mode == "sigterm" else {}
    trainer = Recording(model_dir, reward_funcs=spread_reward, args=args, train_dataset=dataset, **extra)
    trainer.train(resume_from_checkpoint=mode.split("=", 1)[1] if mode.startswith("resume=") else None)
    with open(RECORD + ".log.json", "w") as handle:
        json.dump(trainer.state.log_history, handle)
    print("finished", trainer.state.global_step, flush=True)
'''


def start(
    script: Path, mode: str, model_dir: str, out_dir: Path, record: Path, backend: str = "local"
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), mode, model_dir, str(out_dir), str(record), str(NUM_PROMPTS), backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def entries(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def finish(process: subprocess.Popen, timeout_s: float = 600) -> str:
    out, err = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, err[-6000:]
    return out


def test_a_run_killed_mid_way_and_resumed_trains_every_prompt_of_the_epoch(tmp_path, tiny_model_dir):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    whole = tmp_path / "whole.jsonl"
    finish(start(script, "train", tiny_model_dir, tmp_path / "whole", whole))
    assert sorted(e["done"] for e in entries(whole) if "done" in e) == list(range(NUM_PROMPTS))

    out_dir, first, second = tmp_path / "run", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    killed = start(script, "train", tiny_model_dir, out_dir, first)
    deadline = time.monotonic() + 300
    while not (out_dir / "checkpoint-5" / "rollout_state.json").exists():
        assert killed.poll() is None and time.monotonic() < deadline, killed.stderr.read()[-4000:]
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    time.sleep(2)  # its worker and server notice their parent is gone and exit

    # resume from an earlier checkpoint than the last: the killed run trained on after it, so what the
    # checkpoint counts as done can be checked against what was still trained later
    checkpoint, step = out_dir / "checkpoint-3", 3
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    done_at_checkpoint = set(range(state["trained_position"])) | set(state["done_positions"])
    trained_later = {e["trained"] for e in entries(first) if "trained" in e and e["step"] > step}
    assert trained_later, "the killed run trained after the checkpoint"
    assert not trained_later & done_at_checkpoint  # nothing counted done still had samples to train

    finish(start(script, f"resume={checkpoint}", tiny_model_dir, out_dir, second))
    done_after = [e["done"] for e in entries(second) if "done" in e]
    assert len(done_after) == len(set(done_after))
    # none lost, none done twice: the checkpoint and the resumed run together are one whole epoch
    assert done_at_checkpoint | set(done_after) == set(range(NUM_PROMPTS))
    assert not done_at_checkpoint & set(done_after)
    # samples trained twice only for the prompts the checkpoint says were partly trained
    trained_before = {e["trained"] for e in entries(first) if "trained" in e and e["step"] <= step}
    trained_after = {e["trained"] for e in entries(second) if "trained" in e}
    assert trained_before & trained_after <= set(state["retrained_positions"])
    history = json.loads(Path(f"{second}.log.json").read_text())
    counted = [
        entry["resume/retrained_prompt_count"]
        for entry in history
        if "resume/retrained_prompt_count" in entry
    ]
    assert counted == [len(state["retrained_positions"])]


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
def test_sigterm_stops_the_run_with_a_checkpoint_and_leaves_no_sandbox_server_or_worker(
    tmp_path, tiny_model_dir, backend
):
    from leftovers import live_children  # noqa: F401 - the helper's module, for the process table below

    from sandboxes.local import sandbox_root

    script = tmp_path / "run.py"
    script.write_text(RUN)
    out_dir, record = tmp_path / "run", tmp_path / "record.jsonl"
    before = set(sandbox_root().glob("*")) if sandbox_root().exists() else set()
    containers_before = our_containers() if backend == "docker" else set()
    run = start(script, "sigterm", tiny_model_dir, out_dir, record, backend)

    deadline = time.monotonic() + 300
    while not any("trained" in e for e in entries(record)):  # a step trained, sandboxes in use
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-4000:]
        time.sleep(0.1)
    while backend == "docker" and not our_containers() - containers_before:  # stopped with containers up
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-4000:]
        time.sleep(0.05)
    descendants = _descendants(run.pid)
    assert descendants, "the run has a worker and a server"
    stopped_at = time.monotonic()
    run.send_signal(signal.SIGTERM)
    out = finish(run, timeout_s=120)
    assert time.monotonic() - stopped_at < 60
    assert "finished" in out
    (checkpoint,) = out_dir.glob("checkpoint-*")  # save_steps is 1000: this one is the SIGTERM's
    assert (checkpoint / "rollout_state.json").exists()
    time.sleep(1)
    assert [pid for pid in descendants if _alive(pid)] == []
    from sandboxes import processes

    # a sandbox process of the run's, started after the look at its descendants (bwrap mid-setup included)
    left = [p.pid for p in processes.executor_processes() if p.owner.pid in descendants]
    assert left == []
    after = set(sandbox_root().glob("*")) if sandbox_root().exists() else set()
    assert after <= before, f"sandbox directories left: {sorted(after - before)}"
    if backend == "docker":
        assert our_containers() <= containers_before, "containers left"


def our_containers() -> set[str]:
    """The ids of every container the harness made that exists now."""
    from sandboxes.engine import LABELS, docker_client

    managed = {"label": LABELS["managed"]}
    return {c["Id"] for c in docker_client().api.containers(all=True, filters=managed)}


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found += sorted(frontier)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"

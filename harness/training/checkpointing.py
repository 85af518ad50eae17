"""Checkpoints of an AsyncGRPOTrainer run, and resuming from one: the run's counters (`RunCounters`) and
the component that saves and loads everything else (`Checkpointer`).

`trainer.save_checkpoint()` (every `save_steps` steps with `save_strategy="steps"`) writes
`output_dir/checkpoint-<global_step>/`:

    the weights          the model (safetensors + config), or a PEFT model's adapter alone; the tokenizer
                         and training_args.bin beside them
    optimizer.pt         the optimizer's full (unsharded) state dict
    scheduler.pt         the learning-rate scheduler's state dict
    trainer_state.json   transformers' TrainerState (global step, log history)
    rollout_state.json   the global step and the run's counters, `RunCounters` whole (field by field below)

`train(resume_from_checkpoint=...)` takes a folder, or True for the highest-numbered checkpoint in
output_dir. With one process the optimizer and scheduler are created first, then the weights (or the
adapter), the optimizer and scheduler states are loaded, and the counters come back from
rollout_state.json. Under FSDP2 (several processes, harness/training/fsdp.py) the weights must be in place
before the model is sharded: rank 0 loads them into its full model and broadcasts them to the other
processes (`load_weights_before_sharding`); after sharding the optimizer is created and rank 0's
optimizer.pt is loaded into every process's shards; each process reads the scheduler and the counters.

Saving under FSDP2, every process helps gather the full state dicts and rank 0 writes the same files one
process would. So a checkpoint does not depend on the number of processes that wrote it: a run saved on two
processes resumes on one, and the other way round.

Who talks to it: AsyncGRPOTrainer (harness/training/trainer.py) builds a Checkpointer once its optimizer
exists, saves from `_after_step`, and resumes in `_setup_run`; the rollout worker restarts at the resumed
counters' `trained_position`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.training.processes import Processes

ROLLOUT_STATE_FILE = "rollout_state.json"


@dataclass
class RunCounters:
    """Where a run stands, beyond the weights and the optimizer: saved and restored whole.

    Attributes:
        model_version: The policy version the generation server has (bumped at each weight sync).
        trained_position: The first prompt position not yet done: the rollout worker restarts there after a
            resume. A prompt is done once every sample of it was trained on or dropped (or it had none):
            prompts whose samples were pulled but not yet trained are not, so a resume generates them
            again instead of losing them.
        done_positions: Prompt positions past `trained_position` that are done (groups finish out of
            order); the resumed worker skips them.
        retrained_positions: Prompts some of whose samples were trained when the checkpoint was written
            but not all: generated again after a resume, so those samples are trained twice (counted in
            `resume/retrained_prompt_count`).
        prompts_done: Prompts done: what the epoch counts.
        tokens_consumed: Tokens the trainer has taken from the worker (trained or dropped), in the unit of
            the worker's token allowance (harness/rollout/pacing.py).
        last_step_tokens: The last step's share of them (the allowance grows by max_staleness such steps).
        num_tokens: Tokens forwarded so far (the `num_tokens` metric).
    """

    model_version: int = 0
    trained_position: int = 0
    done_positions: list[int] = dataclasses.field(default_factory=list)
    retrained_positions: list[int] = dataclasses.field(default_factory=list)
    prompts_done: int = 0
    tokens_consumed: float = 0.0
    last_step_tokens: float = 0.0
    num_tokens: int = 0

    def to_json(self, global_step: int) -> str:
        return json.dumps({"global_step": global_step, **dataclasses.asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> tuple[RunCounters, int]:
        """The counters and the global step of a rollout_state.json (a field it lacks keeps its default)."""
        state = json.loads(text)
        global_step = int(state.pop("global_step"))
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"{ROLLOUT_STATE_FILE} has fields this version does not know: {unknown}")
        return cls(**state), global_step


class Checkpointer:
    """Writes and reads the checkpoint folders of one run (see the module docstring).

    It holds what a checkpoint is made of; `save_model` and `load_model` are the transformers.Trainer's own
    (safetensors or a PEFT adapter, and whatever weight renaming the model's class does).
    """

    def __init__(
        self,
        *,
        output_dir: str | Path,
        processes: Processes,
        model: Any,
        optimizer: Any,
        lr_scheduler: Any,
        tokenizer: Any,
        args: Any,
        save_model: Callable[[str], None],
        load_model: Callable[[str], None],
    ) -> None:
        self.output_dir = Path(output_dir)
        self.processes = processes
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.tokenizer = tokenizer
        self.args = args
        self.save_model = save_model
        self.load_model = load_model

    @property
    def sharded(self) -> bool:
        from harness.training.fsdp import is_sharded

        return self.processes.world_size > 1 and is_sharded(self.model)

    def save(self, trainer_state: Any, counters: RunCounters) -> Path:
        """Write checkpoint-<global_step>/; a collective under FSDP2 (every process helps gather)."""
        main = self.processes.is_main
        directory = self.output_dir / f"checkpoint-{trainer_state.global_step}"
        if main:
            directory.mkdir(parents=True, exist_ok=True)
        if self.sharded:
            # FSDP2: every process helps gather the full state dicts, rank 0 writes the usual files (a PEFT
            # model's: its adapter alone, so the frozen base is not gathered)
            from harness.training.fsdp import full_state_dicts

            peft = hasattr(self.model, "peft_config")
            model_state, optimizer_state = full_state_dicts(self.model, self.optimizer, trainable_only=peft)
            if main:
                self.model.save_pretrained(str(directory), state_dict=model_state)
                self.tokenizer.save_pretrained(str(directory))
                torch.save(self.args, directory / "training_args.bin")
            del model_state
        else:
            self.save_model(str(directory))
            optimizer_state = self.optimizer.state_dict()
        if main:
            torch.save(optimizer_state, directory / "optimizer.pt")
            torch.save(self.lr_scheduler.state_dict(), directory / "scheduler.pt")
            (directory / ROLLOUT_STATE_FILE).write_text(counters.to_json(trainer_state.global_step))
            trainer_state.save_to_json(str(directory / "trainer_state.json"))
        self.processes.barrier()  # the checkpoint is whole before any process goes on
        return directory

    def load(self, directory: Path) -> tuple[RunCounters, int]:
        """A checkpoint's optimizer, scheduler and counters (and global step); its weights too, unless FSDP2
        loaded them before sharding (`load_weights_before_sharding`)."""
        counters, global_step = RunCounters.from_json((directory / ROLLOUT_STATE_FILE).read_text())
        if self.sharded:
            from harness.training.fsdp import load_full_optimizer_state_dict

            optimizer_state = {}
            if self.processes.is_main:
                optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
            load_full_optimizer_state_dict(self.model, self.optimizer, optimizer_state)
        else:
            self.load_model(str(directory))
            self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
        return counters, global_step


def checkpoint_directory(output_dir: str | Path, checkpoint: str | bool) -> Path:
    """The folder `resume_from_checkpoint` names: a path, or True for the last one in output_dir."""
    if isinstance(checkpoint, str):
        return Path(checkpoint)
    checkpoints = sorted(Path(output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoint to resume from in {output_dir}")
    return checkpoints[-1]


def load_weights_before_sharding(model: Any, directory: Path, processes: Processes) -> None:
    """FSDP2 resume: rank 0 loads the checkpoint's weights into its full model (what a one-process
    checkpoint holds: a PEFT model's adapter, else the whole model), then every process takes rank 0's
    trainable parameters (a full model: every tensor), so the shards start from them. A collective."""
    from harness.training.fsdp import broadcast_from_rank0

    peft = hasattr(model, "peft_config")
    if processes.is_main and peft:
        model.load_adapter(str(directory), adapter_name=model.active_adapter, is_trainable=True)
    elif processes.is_main:
        # from_pretrained, not the raw files: it undoes whatever weight renaming the model's saving did
        dtype = next(iter(model.parameters())).dtype
        saved = type(model).from_pretrained(str(directory), dtype=dtype)
        model.load_state_dict(saved.state_dict())
        del saved
    tensors = [p for p in model.parameters() if p.requires_grad] if peft else model.state_dict().values()
    broadcast_from_rank0(tensors)


__all__ = [
    "ROLLOUT_STATE_FILE",
    "Checkpointer",
    "RunCounters",
    "checkpoint_directory",
    "load_weights_before_sharding",
]

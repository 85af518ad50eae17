"""Checkpoints of an AsyncGRPOTrainer run, and resuming from one (`CheckpointMixin`, which it inherits).

`trainer.save_checkpoint()` (every `save_steps` steps with `save_strategy="steps"`) writes
`output_dir/checkpoint-<global_step>/`:

    the weights          the model (safetensors + config), or a PEFT model's adapter alone; the tokenizer
                         and training_args.bin beside them
    optimizer.pt         the optimizer's full (unsharded) state dict
    scheduler.pt         the learning-rate scheduler's state dict
    trainer_state.json   transformers' TrainerState (global step, log history)
    rollout_state.json   where the run stands: trained_position (the first prompt position not yet trained
                         on or dropped: the rollout worker restarts there), model_version (the policy
                         version), global_step, tokens_consumed (in the worker's token-allowance unit),
                         num_tokens (forwarded tokens so far), prompts_done (what the epoch counts)

`train(resume_from_checkpoint=...)` takes a folder, or True for the highest-numbered checkpoint in
output_dir. With one process the optimizer and scheduler are created first, then the Trainer loads the
weights (or the adapter), the optimizer and scheduler states are loaded, and the counters are set from
rollout_state.json. Under FSDP2 (several processes, harness/training/fsdp.py) the weights must be in place
before the model is sharded: rank 0 loads them into its full model and broadcasts them to the other processes
(`_load_weights_before_sharding`); after sharding the optimizer is created and rank 0's optimizer.pt is
loaded into every process's shards; each process reads the scheduler and the counters itself.

Saving under FSDP2, every process helps gather the full state dicts and rank 0 writes the same files one
process would. So a checkpoint does not depend on the number of processes that wrote it: a run saved on two
processes resumes on one, and the other way round.

Who talks to it: AsyncGRPOTrainer (harness/training/trainer.py), whose `_setup_run` resolves the folder, loads
the weights before sharding (`_shard_model`) and resumes, and whose `_after_step` saves. The mixin uses the
transformers.Trainer's model, optimizer, lr_scheduler, state and accelerator, the trainer's `_is_main`, and
the counters `_setup_run` initialises (trained_frontier, model_version, tokens_consumed, num_tokens_total,
prompts_done).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROLLOUT_STATE_FILE = "rollout_state.json"


class CheckpointMixin:
    """Save and resume for AsyncGRPOTrainer (see the module docstring); mixed into a transformers.Trainer."""

    def save_checkpoint(self) -> Path:
        """Model, optimizer and scheduler state, and rollout_state.json (where the prompts resume)."""
        directory = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        if self._is_main:
            directory.mkdir(parents=True, exist_ok=True)
        if self._sharded:
            # FSDP2: every process helps gather the full state dicts, rank 0 writes the usual files (a PEFT
            # model's: its adapter alone, so the frozen base is not gathered)
            from harness.training.fsdp import full_state_dicts

            peft = hasattr(self.model, "peft_config")
            model_state, optimizer_state = full_state_dicts(self.model, self.optimizer, trainable_only=peft)
            if self._is_main:
                self.model.save_pretrained(str(directory), state_dict=model_state)
                self.processing_class.save_pretrained(str(directory))
                torch.save(self.args, directory / "training_args.bin")
            del model_state
        else:
            self.save_model(str(directory))
            optimizer_state = self.optimizer.state_dict()
        if self._is_main:
            torch.save(optimizer_state, directory / "optimizer.pt")
            torch.save(self.lr_scheduler.state_dict(), directory / "scheduler.pt")
            state = {
                "trained_position": self.trained_frontier,
                "model_version": self.model_version,
                "global_step": self.state.global_step,
                "tokens_consumed": self.tokens_consumed,
                "num_tokens": self.num_tokens_total,
                "prompts_done": getattr(self, "prompts_done", 0),
            }
            (directory / ROLLOUT_STATE_FILE).write_text(json.dumps(state, indent=2))
            self.state.save_to_json(str(directory / "trainer_state.json"))
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()  # the checkpoint is whole before any process goes on
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return directory

    def _checkpoint_directory(self, checkpoint: str | bool) -> Path:
        """The folder `resume_from_checkpoint` names: a path, or True for the last one in output_dir."""
        directory = (
            Path(checkpoint) if isinstance(checkpoint, str) else _last_checkpoint(self.args.output_dir)
        )
        if directory is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.args.output_dir}")
        return directory

    def _resume(self, directory: Path) -> None:
        """A checkpoint's optimizer, scheduler and rollout state; its weights too, unless FSDP2 loaded them
        before sharding (`_load_weights_before_sharding`)."""
        state = json.loads((directory / ROLLOUT_STATE_FILE).read_text())
        if self._sharded:
            from harness.training.fsdp import load_full_optimizer_state_dict

            optimizer_state = {}
            if self._is_main:
                optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
            load_full_optimizer_state_dict(self.model, self.optimizer, optimizer_state)
        else:
            self._load_from_checkpoint(str(directory))
            self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
        self.trained_frontier = state["trained_position"]
        self.model_version = state["model_version"]
        self.state.global_step = state["global_step"]
        self.tokens_consumed = state["tokens_consumed"]
        self.num_tokens_total = state["num_tokens"]
        self.prompts_done = state["prompts_done"]

    @property
    def _sharded(self) -> bool:
        from harness.training.fsdp import is_sharded

        return self.args.world_size > 1 and is_sharded(self.model)

    def _load_weights_before_sharding(self, directory: Path) -> None:
        """FSDP2 resume: rank 0 loads the checkpoint's weights into its full model (what a one-process
        checkpoint holds: a PEFT model's adapter, else the whole model), then every process takes rank 0's
        trainable parameters (a full model: every tensor), so the shards start from them. A collective."""
        from harness.training.fsdp import broadcast_from_rank0

        model = self.model
        peft = hasattr(model, "peft_config")
        if self._is_main and peft:
            model.load_adapter(str(directory), adapter_name=model.active_adapter, is_trainable=True)
        elif self._is_main:
            # from_pretrained, not the raw files: it undoes whatever weight renaming the model's saving did
            dtype = next(iter(model.parameters())).dtype
            saved = type(model).from_pretrained(str(directory), dtype=dtype)
            model.load_state_dict(saved.state_dict())
            del saved
        tensors = [p for p in model.parameters() if p.requires_grad] if peft else model.state_dict().values()
        broadcast_from_rank0(tensors)


def _last_checkpoint(output_dir: str) -> Path | None:
    checkpoints = sorted(Path(output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return checkpoints[-1] if checkpoints else None


__all__ = ["ROLLOUT_STATE_FILE", "CheckpointMixin"]

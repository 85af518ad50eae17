"""A custom rollout loop: a curriculum that stops sampling the prompts the policy already solves.

What it shows: subclassing `AsyncRolloutLoop` and overriding only the hooks that change (setup,
filter_prompt, compute_advantages), with its threshold in an `AsyncGRPOConfig` subclass, then using it as
the trainer's `loop_cls`. The loop runs in the spawned rollout process, so both classes live at module
level. It logs curriculum/skipped_count (prompts skipped in the window) and curriculum/tracked_prompts
(prompts with a known pass rate) next to the usual metrics.

    python examples/curriculum.py --max-steps 2                        # CPU, tiny random model
    python examples/curriculum.py --model Qwen/Qwen2.5-0.5B-Instruct --max-steps 300   # one GPU
    harness train examples/curriculum.toml                             # the same from a run spec
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from quickstart import math_problems
from tiny import save_tiny_model, spread_reward

from harness import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = field(
        default=0.9, metadata={"help": "Skip a prompt once this fraction of its last group solved it."}
    )
    solved_reward: float = field(
        default=1.0, metadata={"help": "A rollout whose total reward reaches this counts as solved."}
    )


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """Remembers each prompt's last pass rate and skips the prompts at or above the cap."""

    async def setup(self) -> None:
        self.pass_rates: dict[int, float] = {}

    def filter_prompt(self, row_index, row, epoch) -> bool:
        keep = self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap
        if not keep:
            self.window.add("curriculum/skipped_count", 1)
        return keep

    def compute_advantages(self, group) -> np.ndarray:
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored >= self.config.solved_reward))
        self.window.add("curriculum/tracked_prompts", len(self.pass_rates))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


def main() -> None:
    from harness.rewards import accuracy_reward
    from harness.train_config import MetricsFile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or hub id (default: a tiny random model, offline)")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--output-dir", default="runs/curriculum")
    parser.add_argument("--pass-rate-cap", type=float, default=0.9)
    cli = parser.parse_args()

    tiny = cli.model is None
    args = CurriculumConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        pass_rate_cap=cli.pass_rate_cap,
        num_generations=4 if tiny else 8,
        max_completion_length=16 if tiny else 256,
        learning_rate=1e-3 if tiny else 1e-6,
        token_budget=1024 if tiny else None,
        max_concurrent_rollouts=8 if tiny else 64,
        gradient_checkpointing=not tiny,
        generation_server="builtin",
        save_strategy="no",
        report_to="none",
    )
    trainer = CurriculumTrainer(
        model=cli.model or save_tiny_model(),
        reward_funcs=[accuracy_reward, spread_reward] if tiny else accuracy_reward,
        args=args,
        train_dataset=math_problems(),
        callbacks=[MetricsFile(Path(cli.output_dir) / "metrics.jsonl")],
    )
    trainer.train()


if __name__ == "__main__":  # the rollout worker is a spawned process that imports this file again
    main()

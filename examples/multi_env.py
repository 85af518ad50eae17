"""Several environments in one run, routed by the dataset's `environment` column.

What it shows: `environment_factory` as a dict of route name -> environment (here registry names of
three bundled environments). Each row names its environment; only that environment's tools are shown
in its prompt, and its `get_reward` scores the rollout. Per-environment metrics are logged under
env/{name}/... (reward, completion_length, tool_call_count, ...) and printed at the end.

    python examples/multi_env.py --max-steps 2                          # CPU, tiny random model
    python examples/multi_env.py --model Qwen/Qwen3-0.6B --max-steps 500     # one GPU
    harness train examples/multi_env.toml                               # the same from a run spec
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tiny import save_tiny_model, spread_reward

ENVIRONMENTS = {"arithmetic": "arithmetic", "counter": "counter", "word-guess": "word-guess"}


def mixed_rows(num_rows: int = 300) -> Any:
    """Rows cycling through the environments, each with a `seed` its environment builds the task from."""
    from datasets import Dataset

    names = list(ENVIRONMENTS)
    return Dataset.from_dict(
        {"environment": [names[i % len(names)] for i in range(num_rows)], "seed": list(range(num_rows))}
    )


def main() -> None:
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.train_config import MetricsFile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or hub id (default: a tiny random model, offline)")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--output-dir", default="runs/multi-env")
    cli = parser.parse_args()

    tiny = cli.model is None
    args = AsyncGRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        num_generations=4 if tiny else 8,
        max_completion_length=12 if tiny else 512,
        max_tool_calling_iterations=2 if tiny else 8,  # a random model never stops calling
        learning_rate=1e-3 if tiny else 1e-6,
        token_budget=1024 if tiny else None,
        max_concurrent_rollouts=8 if tiny else 64,
        gradient_checkpointing=not tiny,
        chat_template_kwargs=None if tiny else {"enable_thinking": False},
        generation_server="builtin",
        save_strategy="no",
        report_to="none",
    )
    trainer = AsyncGRPOTrainer(
        model=cli.model or save_tiny_model(),
        reward_funcs=[spread_reward] if tiny else None,  # otherwise the environments' get_reward alone
        args=args,
        train_dataset=mixed_rows(),
        environment_factory=ENVIRONMENTS,
        callbacks=[MetricsFile(Path(cli.output_dir) / "metrics.jsonl")],
    )
    trainer.train()
    per_environment: dict[str, float] = {}
    for entry in trainer.state.log_history:
        per_environment.update({key: value for key, value in entry.items() if key.startswith("env/")})
    print(json.dumps(per_environment, sort_keys=True))  # one line: env/{name}/{metric} -> last value


if __name__ == "__main__":  # the rollout worker is a spawned process that imports this file again
    main()

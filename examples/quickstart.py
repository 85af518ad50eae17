"""Quick start: asynchronous GRPO on generated arithmetic questions, scored with `accuracy_reward`.

What it shows: the smallest complete run through the Python API. A dataset of conversational prompts
with a `solution` column, a ready-made reward function, a model, and `AsyncGRPOTrainer(...).train()`.
Everything is offline: the questions are generated here, and without --model the model is a tiny
random one (harness.testing) saved to a temporary folder; the built-in generation server serves it.

    python examples/quickstart.py --max-steps 2                      # CPU, tiny random model, ~1 min
    python examples/quickstart.py --model Qwen/Qwen2.5-0.5B-Instruct --max-steps 300   # one GPU
    python examples/quickstart.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --server-url http://localhost:8000                            # a vLLM server on another GPU

The same run from a file: `harness train examples/quickstart.toml` (see that file). Metrics go to
OUTPUT_DIR/metrics.jsonl; the names are the reference's (reward, rewards/accuracy_reward/mean, ...).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from tiny import save_tiny_model, spread_reward


def math_problems(num_rows: int = 256, seed: int = 0) -> Any:
    """Questions such as "What is 17 * 4 - 9?" as one user message each, with their `solution`."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts, solutions = [], []
    for _ in range(num_rows):
        a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 30)
        op = rng.choice(["+", "-"])
        question = f"What is {a} * {b} {op} {c}? Put the final answer in \\boxed{{}}."
        prompts.append([{"role": "user", "content": question}])
        solutions.append(str(a * b + c if op == "+" else a * b - c))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


def main() -> None:
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.rewards import accuracy_reward
    from harness.train_config import MetricsFile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or hub id (default: a tiny random model, offline)")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--output-dir", default="runs/quickstart")
    parser.add_argument("--server-url", help="a running vLLM server (default: the built-in server)")
    cli = parser.parse_args()

    tiny = cli.model is None
    args = AsyncGRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        num_generations=4 if tiny else 8,
        max_completion_length=16 if tiny else 256,
        learning_rate=1e-3 if tiny else 1e-6,
        token_budget=1024 if tiny else None,
        max_concurrent_rollouts=8 if tiny else 64,
        gradient_checkpointing=not tiny,
        generation_server="external" if cli.server_url else "builtin",
        vllm_server_base_url=cli.server_url or "http://localhost:8000",
        save_strategy="no",
        report_to="none",
    )
    trainer = AsyncGRPOTrainer(
        model=cli.model or save_tiny_model(),
        reward_funcs=[accuracy_reward, spread_reward] if tiny else accuracy_reward,
        args=args,
        train_dataset=math_problems(),
        callbacks=[MetricsFile(Path(cli.output_dir) / "metrics.jsonl")],
    )
    trainer.train()
    final = trainer.state.log_history[-1] if trainer.state.log_history else {}
    print(json.dumps({key: final[key] for key in ("reward", "loss", "num_tokens") if key in final}))


if __name__ == "__main__":  # the rollout worker is a spawned process that imports this file again
    main()

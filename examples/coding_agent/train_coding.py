"""A coding agent: the bundled python-coding environment, each rollout in its own Docker container.

What it shows: an environment whose manifest asks for a sandbox. Every rollout gets a fresh container
(no network, cgroup limits) where the model's write_file / python / bash calls run; when the rollout
ends, its solution.py is graded by hidden tests in another fresh container. `DockerCodingEnv` is the
bundled environment with its sandbox backend pinned to "docker" (the bundled one says "auto").

Needs a running Docker engine and the sandbox image (`harness sandbox build-image`, once); without
Docker, `--sandbox-backend auto` runs the same in bubblewrap sandboxes.

    python examples/coding_agent/train_coding.py --max-steps 2          # CPU, tiny random model
    python examples/coding_agent/train_coding.py --model Qwen/Qwen3-1.7B --max-steps 500 \\
        --max-completion-length 1024 --num-generations 8                  # one GPU
    harness train examples/coding_agent/coding_agent.toml                # the same from a run spec
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from environments.coding import CodingEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for tiny.py
from tiny import save_tiny_model, spread_reward


class DockerCodingEnv(CodingEnv):
    """python-coding with its rollouts' sandboxes always in Docker containers."""

    manifest = dataclasses.replace(
        CodingEnv.manifest, sandbox=dataclasses.replace(CodingEnv.manifest.sandbox, backend="docker")
    )


def main() -> None:
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.train_config import MetricsFile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or hub id (default: a tiny random model, offline)")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--output-dir", default="runs/coding-agent")
    parser.add_argument(
        "--sandbox-backend",
        choices=["docker", "auto"],
        default="docker",
        help='"auto": the bundled environment, Docker when it answers, else bubblewrap (no Docker needed)',
    )
    parser.add_argument(
        "--spread-reward",
        action="store_true",
        help="add examples/tiny.py's spread reward (always on for the tiny model): a random model's groups "
        "otherwise all score 0 and are dropped, so no step would ever fill",
    )
    cli = parser.parse_args()

    tiny = cli.model is None
    args = AsyncGRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        num_generations=cli.num_generations,
        max_completion_length=cli.max_completion_length,
        max_tool_calling_iterations=2 if tiny else 10,
        learning_rate=1e-3 if tiny else 1e-6,
        token_budget=1024 if tiny else None,
        max_concurrent_rollouts=8 if tiny else 32,  # one container each
        gradient_checkpointing=not tiny,
        generation_server="builtin",
        save_strategy="no",
        report_to="none",
    )
    trainer = AsyncGRPOTrainer(
        model=cli.model or save_tiny_model(),
        reward_funcs=[spread_reward] if tiny or cli.spread_reward else None,  # else the hidden tests alone
        args=args,
        train_dataset=CodingEnv.dataset(repeats=4),
        environment_factory=DockerCodingEnv if cli.sandbox_backend == "docker" else CodingEnv,
        callbacks=[MetricsFile(Path(cli.output_dir) / "metrics.jsonl")],
    )
    trainer.train()
    final = trainer.state.log_history[-1] if trainer.state.log_history else {}
    print(json.dumps({key: value for key, value in final.items() if key.startswith(("reward", "env/"))}))


if __name__ == "__main__":  # the rollout worker is a spawned process that imports this file again
    main()

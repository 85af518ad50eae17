"""End to end on CPU: AsyncGRPOTrainer with a tiny model, the built-in server in a subprocess, the rollout
worker in a spawned process; reward functions, tools, environments, checkpoints and resume.

Everything user-supplied is defined at module level: the worker is spawned and unpickles it by name.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from harness.config import AsyncGRPOConfig

pytestmark = pytest.mark.slow


def length_reward(completion_ids, **kwargs):
    """Varies with the sampled tokens, so a random model's groups have a spread (completions of a random
    model all run to max_completion_length, so their lengths alone would not)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


async def async_parity_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c[-1]["content"]) % 2) if c else None for c in completions]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def config(tmp_path: Path, **overrides) -> AsyncGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        num_generations=4,
        max_completion_length=12,
        max_concurrent_rollouts=8,
        max_tool_calling_iterations=2,  # a random model never stops calling: bound its rollouts
        gradient_checkpointing=False,
        learning_rate=1e-3,
        token_budget=400,  # a few groups per step: the steps are filled from kept groups
        save_strategy="no",
        report_to="none",
        generation_server="builtin",
        disable_tqdm=True,
    )
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def prompts(n: int):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(n)]})


def logged(trainer) -> dict[str, float]:
    merged: dict[str, float] = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


def assert_no_leftover_processes(trainer) -> None:
    """The worker is joined and no built-in server started by this process is still running."""
    from leftovers import live_children

    assert not trainer.worker._processes  # stopped and joined
    survivors = live_children("harness.server")
    assert survivors == [], f"a built-in server started by this test survived: {survivors}"


def test_reward_functions_sync_async_and_tools(tmp_path, tiny_model_dir):
    from harness import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        tiny_model_dir,
        reward_funcs=[length_reward, async_parity_reward],
        args=config(tmp_path),
        train_dataset=prompts(8),
        tools=[multiply],
    )
    output = trainer.train()
    assert output.global_step == 2 and math.isfinite(output.training_loss)
    metrics = logged(trainer)
    for name in (
        "reward",
        "rewards/length_reward/mean",
        "rewards/async_parity_reward/mean",
        "loss",
        "entropy",
        "batch/packing_ratio",
        "perf/step_s",
        "perf/fwd_s",
        "rollout/score_queue_size",
        "sample/staleness_max",
        "completions/mean_length",
        "perf/weight_sync_s",
        "perf/warmup_s",
        "rollout/generated_tokens_per_s",
        "num_tokens",
    ):
        assert name in metrics and math.isfinite(metrics[name]), name
    assert 0 < metrics["perf/fwd_s"] < metrics["perf/fwd_bwd_s"]  # the forward alone, without the backward
    assert_no_leftover_processes(trainer)


def test_single_environment_and_a_dict_of_environments(tmp_path, tiny_model_dir):
    from datasets import Dataset

    from harness import AsyncGRPOTrainer

    # A random tiny model never reaches the counter's target, so the environment's reward alone would drop
    # every group (zero std); the length reward gives the groups a spread to train on.
    single = AsyncGRPOTrainer(
        tiny_model_dir, reward_funcs=length_reward, args=config(tmp_path / "a"), environment_factory="counter"
    )
    assert single.train().global_step == 2
    assert "rewards/reached_target/mean" in logged(single)
    rows = Dataset.from_dict({"environment": ["count", "guess"] * 4, "seed": list(range(8))})
    mixed = AsyncGRPOTrainer(
        tiny_model_dir,
        reward_funcs=length_reward,
        args=config(tmp_path / "b"),
        train_dataset=rows,
        environment_factory={"count": "counter", "guess": "word-guess"},
    )
    assert mixed.train().global_step == 2
    metrics = logged(mixed)
    assert "env/count/completion_length" in metrics and "env/guess/completion_length" in metrics
    assert_no_leftover_processes(mixed)


@pytest.mark.parametrize("workers", [1, 2])
def test_checkpoint_then_resume_starts_at_the_trained_position(tmp_path, tiny_model_dir, workers):
    """Also with two rollout worker processes (num_rollout_workers), which share the prompts."""
    from harness import AsyncGRPOTrainer

    dataset = prompts(64)
    first = AsyncGRPOTrainer(
        tiny_model_dir,
        reward_funcs=length_reward,
        args=config(tmp_path, save_strategy="steps", save_steps=2, num_rollout_workers=workers),
        train_dataset=dataset,
    )
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    assert state["global_step"] == 2 and state["model_version"] == 2
    assert state["trained_position"] >= 1  # every prompt before it was trained on or dropped
    assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "model.safetensors").exists()

    second = AsyncGRPOTrainer(
        tiny_model_dir,
        reward_funcs=length_reward,
        args=config(tmp_path, max_steps=3, num_rollout_workers=workers),
        train_dataset=dataset,
    )
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.state.global_step == 3 and second.worker.num_processes == workers
    assert second.worker.loop_kwargs["dataset_start_index"] == state["trained_position"]
    assert second.counters.trained_position >= state["trained_position"]


def test_a_closure_reward_function_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    from harness import AsyncGRPOTrainer

    def local_reward(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = AsyncGRPOTrainer(
        tiny_model_dir, reward_funcs=local_reward, args=config(tmp_path), train_dataset=prompts(4)
    )
    with pytest.raises(
        TypeError, match=r"reward function .*local_reward cannot be sent to the rollout worker"
    ):
        trainer.train()


@pytest.mark.parametrize("top_k", [0, 5])
def test_at_zero_staleness_the_builtin_servers_logprobs_are_the_trainers(tmp_path, tiny_model_dir, top_k):
    """Finding 3 of the vLLM issue, on the built-in server: under top_k the server returns each token's
    candidate set and the trainer renormalises over it, so at zero staleness the sampler's log-probs are
    the trainer's (before, with top_k = 5 every token differed by ~5 nats and was dropped from the loss)."""
    from harness import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        tiny_model_dir,
        reward_funcs=[length_reward],
        args=config(tmp_path, top_k=top_k, max_staleness=0, max_steps=2),
        train_dataset=prompts(16),
    )
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "sampling/masked_mean" in entry]
    assert len(steps) == 2
    for entry in steps:
        assert entry["sampling/sampling_logp_difference/mean"] <= 1e-5, entry
        assert entry["sampling/masked_mean"] == 0.0, entry
        assert entry.get("sampling/candidate_set_unknown_count", 0) == 0, entry
    assert_no_leftover_processes(trainer)

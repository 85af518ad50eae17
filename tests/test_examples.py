"""The examples run: each script trains two steps on CPU with its default tiny random model and writes the
reference's metric names; each run spec next to them resolves with the CPU overrides its header gives."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
COMMON_METRICS = (
    "reward",
    "frac_reward_zero_std",
    "loss",
    "entropy",
    "num_tokens",
    "completions/mean_length",
    "rollout/generated_tokens_per_s",
    "rollout/duration_s",
    "sample/staleness_max",
    "batch/packing_ratio",
    "perf/step_s",
)


def run_example(script: str, tmp_path: Path, *flags: str) -> tuple[dict[str, float], str]:
    """Run an example for two steps; returns the metrics it logged (merged over steps) and its stdout."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--max-steps", "2", "--output-dir", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    # the head and the end of the log: a worker's failure names its causes at both
    assert done.returncode == 0, f"{done.stderr[:3000]}\n[...]\n{done.stderr[-5000:]}"
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in entries] == [1, 2]
    merged = {key: value for entry in entries for key, value in entry.items()}
    return merged, done.stdout


def assert_logged(metrics: dict[str, float], names: tuple[str, ...]) -> None:
    for name in names:
        assert name in metrics and math.isfinite(metrics[name]), name


@pytest.mark.slow
def test_quickstart(tmp_path):
    metrics, stdout = run_example("quickstart.py", tmp_path)
    assert_logged(metrics, (*COMMON_METRICS, "rewards/accuracy_reward/mean", "rewards/spread_reward/mean"))
    assert metrics["rewards/accuracy_reward/mean"] == 0.0  # a random model does not do arithmetic
    assert "reward" in json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_multi_env_logs_per_environment_metrics(tmp_path):
    metrics, stdout = run_example("multi_env.py", tmp_path)
    assert_logged(metrics, (*COMMON_METRICS, "env/reset_s", "tools/call_frequency"))
    rewarded = {key.split("/")[1] for key in metrics if key.startswith("env/") and key.endswith("/reward")}
    assert len(rewarded) >= 2 and rewarded <= {"arithmetic", "counter", "word-guess"}
    for name in rewarded:
        assert_logged(metrics, (f"env/{name}/completion_length", f"env/{name}/tool_call_count"))
    printed = json.loads(stdout.strip().splitlines()[-1])
    assert {f"env/{name}/reward" for name in rewarded} <= set(printed)


@pytest.mark.slow
def test_curriculum_loop_runs_as_loop_cls(tmp_path):
    metrics, _ = run_example("curriculum.py", tmp_path)
    assert_logged(metrics, (*COMMON_METRICS, "curriculum/tracked_prompts"))
    assert metrics["curriculum/tracked_prompts"] >= 1


@pytest.mark.slow
@pytest.mark.docker
def test_coding_agent_in_docker(tmp_path):
    metrics, _ = run_example("coding_agent/train_coding.py", tmp_path)
    coding = ("rewards/tests_passed/mean", "env/reset_s", "env/reward_s", "tools/call_frequency")
    assert_logged(metrics, (*COMMON_METRICS, *coding))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (or use the docker test)")
def test_coding_agent_without_docker(tmp_path):
    metrics, _ = run_example("coding_agent/train_coding.py", tmp_path, "--sandbox-backend", "auto")
    coding = ("rewards/tests_passed/mean", "env/reset_s", "env/reward_s", "tools/call_frequency")
    assert_logged(metrics, (*COMMON_METRICS, *coding))


TINY_FLAGS = [
    "model='tiny-model'",
    "args.max_steps=2",
    "args.max_completion_length=16",
    "args.token_budget=1024",
]
THREE_ENVIRONMENTS = {"arithmetic": "arithmetic", "counter": "counter", "word-guess": "word-guess"}


@pytest.mark.parametrize(
    ("spec", "overrides", "expected"),
    [
        ("quickstart.toml", ['reward_funcs=["harness.rewards:accuracy_reward", "tiny:spread_reward"]'], {}),
        (
            "multi_env.toml",
            ['reward_funcs=["tiny:spread_reward"]', "args.max_tool_calling_iterations=2"],
            {"environment_factory": THREE_ENVIRONMENTS},
        ),
        ("curriculum.toml", [], {"loop_cls": "curriculum:CurriculumRolloutLoop"}),
        (
            "coding_agent/coding_agent.toml",
            ['reward_funcs=["tiny:spread_reward"]', "args.num_generations=4"],
            {"environment_factory": "train_coding:DockerCodingEnv"},
        ),
    ],
)
def test_each_run_spec_resolves_with_its_cpu_overrides(spec, overrides, expected):
    from harness.train_config import run

    resolved = run(EXAMPLES / spec, [*TINY_FLAGS, *overrides], dry_run=True)
    assert resolved["model"] == "tiny-model" and resolved["args"]["max_steps"] == 2
    assert {key: resolved[key] for key in expected} == expected


def test_the_curriculum_spec_sets_its_config_subclass_field():
    from harness.train_config import load_spec, resolve

    resolved = resolve(load_spec(EXAMPLES / "curriculum.toml", ["args.pass_rate_cap=0.5"]))
    assert type(resolved.args).__name__ == "CurriculumConfig" and resolved.args.pass_rate_cap == 0.5
    assert resolved.loop_cls.__name__ == "CurriculumRolloutLoop"


def test_the_docker_coding_environment_pins_the_docker_backend():
    from harness.train_config import load_spec, resolve

    resolved = resolve(load_spec(EXAMPLES / "coding_agent" / "coding_agent.toml"))
    assert resolved.environment_factory.manifest.sandbox.backend == "docker"
    assert len(resolved.train_dataset) >= 4 * 48 and resolved.train_dataset.column_names == ["task"]


@pytest.mark.slow
def test_the_env_plugin_readme_spec_resolves_once_the_plugin_is_installed(tmp_path):
    """The run spec in examples/env-plugin/README.md, as written there, with the package installed."""
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    install = [*pip, "--no-index", "--target", str(site), str(EXAMPLES / "env-plugin")]
    subprocess.run(install, check=True, capture_output=True, cwd=tmp_path)
    readme = (EXAMPLES / "env-plugin" / "README.md").read_text()
    spec = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "reverse_words.toml").write_text(spec)
    env = {**os.environ, "PYTHONPATH": str(site)}
    command = [sys.executable, "-m", "harness.cli", "train", "reverse_words.toml", "--dry-run"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["environment_factory"] == "reverse-words"
    misspelt = subprocess.run(
        [*command, "--set", "environment_factory=reverse-word"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert misspelt.returncode == 2 and "Did you mean 'reverse-words'?" in misspelt.stderr

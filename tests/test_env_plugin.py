"""The example third-party package under examples/env-plugin, installed for real (no network), is found
through its entry point, listed, loaded and played."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "env-plugin"

EPISODE = """
import json, anyio
from environments import environment_tools, load, validate_environment
from tools import ToolCall, ToolExecutor

async def main():
    cls = load("reverse-words")
    env = cls()
    prompt = env.reset(seed=0)
    answer = " ".join(reversed(env.sentence.split()))
    toolset = environment_tools(env, validate_environment(cls))
    with ToolExecutor() as executor:
        result = await executor.run_one(ToolCall("submit", {"text": answer}), toolset)
    print(json.dumps({"prompt": prompt, "tool": result.content, "reward": env.get_reward()}))

anyio.run(main)
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(PLUGIN),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path_factory.mktemp("build"),
    )
    return str(target)


def run_with_plugin(plugin_path: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": plugin_path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_installed_plugin_is_listed_by_harness_envs_list(plugin_path):
    listing = run_with_plugin(plugin_path, "-m", "harness.cli", "envs", "list")
    assert listing.returncode == 0, listing.stderr
    line = next(line for line in listing.stdout.splitlines() if line.startswith("reverse-words"))
    assert "0.1.0" in line and "plugin harness-env-example 0.1.0" in line
    assert "counter" in listing.stdout  # the bundled ones are still there


@pytest.mark.slow
def test_installed_plugin_loads_and_plays_an_episode(plugin_path):
    episode = run_with_plugin(plugin_path, "-c", EPISODE)
    assert episode.returncode == 0, episode.stderr
    outcome = json.loads(episode.stdout.strip().splitlines()[-1])
    assert outcome["prompt"].startswith("Reverse the order of the words in:")
    assert outcome["tool"] == "Submitted." and outcome["reward"] == 1.0

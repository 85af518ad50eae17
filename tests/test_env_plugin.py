"""The example third-party package under examples/env-plugin, installed for real (no network), is found
through its entry point, listed, loaded and played."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


HOSTILE_PLUGINS = {
    "hostile_plugins/__init__.py": "",
    "hostile_plugins/exits.py": "raise SystemExit(3)\n",
    "hostile_plugins/hangs.py": "import time\ntime.sleep(3600)\n",
    "hostile_plugins/fine.py": (
        "from environments import Environment, Manifest\n\n\n"
        "class FineEnv(Environment):\n"
        '    manifest = Manifest(name="c-fine", version="1.2.3", reward_names=("done",))\n\n'
        "    def reset(self, **row):\n"
        '        return "Go."\n\n'
        "    def get_reward(self):\n"
        "        return 1.0\n"
    ),
    "hostile_plugins-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: hostile-plugins\nVersion: 1.0\n",
    "hostile_plugins-1.0.dist-info/entry_points.txt": (
        "[harness.environments]\n"
        "a-exits = hostile_plugins.exits:Env\n"
        "b-hangs = hostile_plugins.hangs:Env\n"
        "c-fine = hostile_plugins.fine:FineEnv\n"
    ),
}


def test_plugins_that_exit_or_hang_at_import_hide_nothing_and_hold_nothing(tmp_path):
    for relative, text in HOSTILE_PLUGINS.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "HARNESS_PLUGIN_IMPORT_TIMEOUT_S": "2",
    }
    started = time.monotonic()
    listing = subprocess.run(
        [sys.executable, "-m", "harness.cli", "envs", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert time.monotonic() - started < 30
    assert listing.returncode == 1, listing.stderr
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()}
    assert "ERROR" in lines["a-exits"] and "SystemExit" in lines["a-exits"]
    assert "ERROR" in lines["b-hangs"] and "did not finish importing within 2 s" in lines["b-hangs"]
    assert "1.2.3" in lines["c-fine"] and "counter" in lines  # listed after the broken ones

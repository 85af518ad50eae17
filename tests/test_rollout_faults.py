"""Fault injection into the rollout loop: what a broken tool, a killed sandbox, a failing server and a
vanished server do to a run.

Each test breaks one real component and checks the loop's promise for that failure: the broken rollout
ends typed (or, for a tool that merely raised, carries on with the error as a tool message), it stays out
of the group's statistics, the other rollouts finish, the failure is counted in the metrics, nothing is
left running afterwards, and when failures dominate the circuit breaker stops the run with a message
naming their type. Generation comes from the shared FakeGenerationServer where the server is beside the point
(tools, sandboxes) and from the real built-in server, on CPU with a tiny random model, where it is the
point (a fault-injecting HTTP proxy in front of it, or the server killed mid-run).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import anyio
import numpy as np
import pytest
from test_rollout_loop import make_loop, metrics, prompt_rows, run_groups, tool_call

from environments.base import Environment
from environments.manifest import Manifest
from harness.generation.client import GenerationClient
from harness.rollout.loop import AsyncRolloutLoop
from harness.rollout.scoring import ADVANTAGE_EPS
from harness.server.launch import start_builtin_server
from sandboxes import errors as sandbox_errors
from sandboxes.backends import create_sandbox
from sandboxes.base import Limits, SandboxSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class RecordingLoop(AsyncRolloutLoop):
    """The stock loop, keeping every scored group so a test can look at the rollouts themselves."""

    async def setup(self) -> None:
        self.groups = []

    def compute_advantages(self, group):
        self.groups.append(group)
        return super().compute_advantages(group)


def all_rollouts(loop: RecordingLoop) -> list:
    return [rollout for group in loop.groups for rollout in group.rollouts]


# One pass over the dataset, then the loop ends by itself: no group beyond the ones a test counts.
ONE_PASS = {"max_steps": -1, "num_train_epochs": 1}


def first_user_text(prompt: str) -> str:
    return prompt.split("user\n")[-1].split("<|im_end|>")[0]


def random_reward(completions, **kwargs):
    """Distinct rewards, so that every group with two scored rollouts is trained."""
    return list(np.random.default_rng().random(len(completions)))


# --- 1. tools that raise or hang ------------------------------------------------------------------------

HANG_S = 60.0
_release_hung_tools = threading.Event()


def explode(reason: str) -> str:
    """Fail loudly.

    Args:
        reason: Why.
    """
    raise ValueError(f"boom: {reason}")


def read_missing(path: str) -> str:
    """Read a file of the sandbox (this one never exists).

    Args:
        path: The file.
    """
    raise sandbox_errors.SandboxFileNotFound(f"no such file in the sandbox: {path}")


def hang() -> str:
    """Never answer (until the test releases it, HANG_S at most)."""
    _release_hung_tools.wait(HANG_S)
    return "too late"


async def hang_async() -> str:
    """Never answer, asynchronously."""
    await anyio.sleep(HANG_S)
    return "too late"


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


async def test_a_raising_tool_becomes_a_tool_error_message_and_the_rollout_carries_on(tmp_path):
    """A tool that raises is the model's problem, not the infrastructure's: the exception becomes the
    tool's answer, the rollout takes its next turn, and the failure shows in the tool metrics only."""
    seen_after_tool: list[str] = []

    def script(prompt: str, call: int) -> str:
        if "<tool_response>" not in prompt:
            return tool_call("explode", {"reason": "disk on fire"})
        seen_after_tool.append(prompt)
        return "sorry, the tool broke"

    loop = make_loop(
        script,
        loop_cls=RecordingLoop,
        dataset=prompt_rows("a", "b"),
        tools=[explode],
        tmp_path=tmp_path,
        num_generations=2,
        **ONE_PASS,
    )
    results = await run_groups(loop, 2)
    rollouts = all_rollouts(loop)
    assert len(rollouts) == 4 and all(not rollout.failed for rollout in rollouts)
    for rollout in rollouts:
        assert len(rollout.turns) == 2  # it went on to a second turn after the failed call
        roles = [message["role"] for message in rollout.completion]
        assert roles == ["assistant", "tool", "assistant"]
        tool_message = rollout.completion[1]
        assert tool_message["name"] == "explode"
        assert tool_message["content"] == "Error: ValueError: boom: disk on fire"
        assert (rollout.tool_call_count, rollout.tool_failure_count) == (1, 1)
    # the model was shown the error inside the tool's response
    assert len(seen_after_tool) == 4
    assert all("Error: ValueError: boom: disk on fire" in prompt for prompt in seen_after_tool)
    assert all(result.samples == [] for result in results)  # equal rewards (none): dropped, not failed
    summary = metrics(loop)
    assert summary["tools/explode/call_count"] == 4
    assert summary["tools/explode/failure_count"] == 4
    assert summary["tools/error_count"] == 4
    assert summary["tools/failure_frequency"] == 1.0
    assert summary["rollout/failed_count"] == 0


async def test_a_missing_sandbox_file_is_the_models_error_not_an_infrastructure_failure(tmp_path):
    """Reading a path that does not exist is a mistake the policy should learn from: the rollout goes on
    with the error as the tool's answer, and nothing is counted as a failed rollout."""

    def script(prompt: str, call: int) -> str:
        if "<tool_response>" not in prompt:
            return tool_call("read_missing", {"path": "notes.txt"})
        return "no notes then"

    loop = make_loop(
        script,
        dataset=prompt_rows("a"),
        tools=[read_missing],
        tmp_path=tmp_path,
        num_generations=2,
        **ONE_PASS,
    )
    await run_groups(loop, 1)
    summary = metrics(loop)
    assert summary["rollout/failed_count"] == 0
    assert summary["tools/read_missing/failure_count"] == 2
    assert summary["tools/error_count"] == 2


@pytest.mark.parametrize("hanging_tool", [hang, hang_async], ids=["sync", "async"])
async def test_a_hanging_tool_times_out_without_holding_up_the_other_rollouts(tmp_path, hanging_tool):
    """A tool past its timeout is an infrastructure failure (see rollout.py's docstring and
    ToolResult.infrastructure): that rollout ends typed "timeout" after the 1 s timeout, not the 60 s hang,
    while the rest of its group and the other groups go on and finish first."""
    name = hanging_tool.__name__
    first_turns = 0

    def script(prompt: str, call: int) -> str:
        nonlocal first_turns
        if "<tool_response>" in prompt:
            return "done"
        first_turns += 1
        # The first group runs alone (no token estimate yet); then two run at once, and the first rollout
        # of whichever starts first hangs, while every other rollout echoes.
        if first_turns == 4:
            return tool_call(name, {})
        return tool_call("echo", {"text": first_user_text(prompt)})

    loop = make_loop(
        script,
        loop_cls=RecordingLoop,
        dataset=prompt_rows("a", "b", "c"),
        tools=[hanging_tool, echo],
        reward_funcs=[random_reward],
        tmp_path=tmp_path,
        num_generations=3,
        tool_timeout_s=1.0,
        max_concurrent_rollouts=16,
        **ONE_PASS,
    )
    started = time.monotonic()
    try:
        results = await run_groups(loop, 3)
        elapsed = time.monotonic() - started
        hung_threads_after_run = loop.executor.hung_threads
    finally:
        _release_hung_tools.set()  # let the abandoned thread end, so the interpreter can exit
    _release_hung_tools.clear()

    assert 1.0 <= elapsed < 10, f"the hang held the run for {elapsed:.1f} s"
    rollouts = all_rollouts(loop)
    failed = [rollout for rollout in rollouts if rollout.failed]
    assert len(rollouts) == 9 and len(failed) == 1
    (hung,) = failed
    assert hung.error_type == "timeout"
    assert f"tool {name}: Error: tool '{name}' timed out after 1 s" in hung.error
    healthy = [rollout for rollout in rollouts if not rollout.failed]
    assert all(r.completion[1]["role"] == "tool" and len(r.turns) == 2 for r in healthy)
    if hanging_tool is hang:  # the sync tool's thread is abandoned, and counted
        assert hung_threads_after_run == 1
    summary = metrics(loop)
    assert summary[f"tools/{name}/failure_count"] == 1
    assert summary["tools/timeout_count"] == 1
    assert summary["tools/echo/failure_count"] == 0
    assert summary["rollout/failed/timeout_count"] == 1
    assert summary["rollout/failed_count"] == 1
    # the hung rollout's group trained on its two healthy rollouts only, the other groups on all three
    hung_group = next(g for g in loop.groups if any(r.failed for r in g.rollouts))
    assert np.isnan(hung_group.rewards).sum() == 1
    assert loop.groups[-1] is hung_group  # the group running beside it did not wait for it
    for result in results:
        trained = {sample.sequence.rollout_id for sample in result.samples}
        assert len(trained) == (2 if result.row_index == hung_group.row_index else 3)
        assert hung.rollout_id not in trained


def readme_tool_metrics() -> list[str]:
    """The metric names the README's Tools section lists under "Metrics (`ToolStats` ...)"."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("- Metrics (`ToolStats`") :]
    section = section[: section.index("\n\n")]
    return re.findall(r"`(tools/[^`]+)`", section)


def nap(seconds: float) -> str:
    """Sleep past the tool timeout.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"


async def test_every_tool_metric_the_readme_lists_is_logged_by_a_real_rollout(tmp_path):
    """One rollout meets each kind of tool outcome the metrics count: a call that works, one the parser
    cannot read, one to a tool that does not exist, one with invalid arguments, one that raises, and a sync
    tool that hangs past its timeout (its thread is abandoned and counted). Every name the README lists
    reaches the loop's logged metrics, through one implementation (tools.ToolStats)."""
    turns = [
        tool_call("echo", {"text": "hi"}),
        '<tool_call>\n{"name": "echo", "arguments": {"text": \n</tool_call>',  # bad JSON
        tool_call("no_such_tool", {}),
        tool_call("echo", {"wrong": 1}),
        tool_call("explode", {"reason": "test"}),
        tool_call("nap", {"seconds": 3}),
    ]

    def script(prompt: str, call: int) -> str:
        turn = prompt.count("<|im_start|>assistant") - 1  # replies so far in this rollout
        return turns[turn] if turn < len(turns) else "done"

    loop = make_loop(
        script,
        dataset=prompt_rows("a"),
        tools=[echo, explode, nap],
        tmp_path=tmp_path,
        num_generations=2,
        tool_timeout_s=0.3,
        max_tool_calling_iterations=10,
        **ONE_PASS,
    )
    await run_groups(loop, 1)
    summary = metrics(loop)
    expected = {  # two rollouts, each with every outcome once
        "tools/echo/call_count": 4,  # the valid call and the one with invalid arguments
        "tools/echo/failure_count": 2,
        "tools/explode/failure_count": 2,
        "tools/nap/failure_count": 2,
        "tools/unknown_name_count": 2,
        "tools/invalid_arguments_count": 2,
        "tools/error_count": 2,
        "tools/timeout_count": 2,
        "tools/parse_error_count": 2,
        "tools/parse_error/qwen_count": 2,
        "tools/parse_error/bad_json_count": 2,
    }
    assert {name: summary.get(name) for name in expected} == expected
    # a gauge read at each flush: 1 or 2 while the two abandoned threads sleep, depending on the flush
    assert 1 <= summary["tools/hung_threads"] <= 2
    assert summary["tools/failure_frequency"] == pytest.approx(4 / 5)  # 5 calls ran, 4 failed
    listed = readme_tool_metrics()
    assert listed, "the README lists no tool metrics"
    concrete = {
        pattern.replace("{name}", "echo").replace("{family}", "qwen").replace("{kind}", "bad_json")
        for pattern in listed
    }
    missing = sorted(name for name in concrete if name not in summary)
    assert not missing, f"listed in the README but not logged: {missing}"


# --- 2. a sandbox killed while a tool runs in it ---------------------------------------------------------

SLEEP_COMMAND = "sleep 37.25"  # unusual enough to find among other people's processes


class StuckHookEnv(Environment):
    """An environment whose sync hook named by `stuck` (reset or get_reward) does not return (until the
    test lets it go, 30 s at most)."""

    manifest = Manifest(name="stuck-hook", reward_names=("never",), episode_timeout_s=1.5)
    release: ClassVar[threading.Event] = threading.Event()
    stuck: ClassVar[str] = "get_reward"

    def reset(self, **row) -> str:
        if StuckHookEnv.stuck == "reset":
            StuckHookEnv.release.wait(30)
        return "Say anything."

    def get_reward(self) -> float:
        if StuckHookEnv.stuck == "get_reward":
            StuckHookEnv.release.wait(30)
        return 1.0


@pytest.mark.parametrize("hook", ["reset", "get_reward"])
async def test_a_sync_hook_that_never_returns_is_bounded_by_the_episode_timeout(tmp_path, hook, monkeypatch):
    """The hook runs on a daemon thread the episode's timeout abandons: its rollouts end typed
    EpisodeTimeout at episode_timeout_s, and the loop finishes without waiting for the thread."""
    monkeypatch.setattr(StuckHookEnv, "stuck", hook)
    monkeypatch.setattr(StuckHookEnv, "release", threading.Event())
    loop = make_loop(
        lambda prompt, call: "an answer",
        loop_cls=RecordingLoop,
        env=StuckHookEnv,
        tmp_path=tmp_path,
        num_generations=2,
        max_steps=1,
    )
    started = time.monotonic()
    try:
        await run_groups(loop, 1)
        elapsed = time.monotonic() - started
    finally:
        StuckHookEnv.release.set()
    rollouts = all_rollouts(loop)
    assert [rollout.error_type for rollout in rollouts] == ["EpisodeTimeout", "EpisodeTimeout"]
    assert 1.5 <= elapsed < 10, elapsed
    assert metrics(loop)["rollout/failed/EpisodeTimeout_count"] == 2


HOOKS_NEVER_RETURN = """
import threading, anyio
from harness.rollout.env_pool import call_hook
from tools.threads import DaemonThreadPool

def reset(**row):
    threading.Event().wait()

def get_reward():
    threading.Event().wait()

async def main():
    threads = DaemonThreadPool(4, name="hooks")
    for hook in (reset, get_reward):
        with anyio.move_on_after(0.2) as scope:
            await call_hook(hook, threads=threads)
        print(hook.__name__, "abandoned" if scope.cancelled_caught else "returned", flush=True)

anyio.run(main)
"""


def test_sync_hooks_that_never_return_do_not_hold_the_process_at_exit():
    """Abandoned by their timeout, hung sync reset and get_reward leave the process free to exit."""
    done = subprocess.run(
        [sys.executable, "-c", HOOKS_NEVER_RETURN], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["reset", "abandoned", "get_reward", "abandoned"]


class SleepyShellEnv(Environment):
    """A shell in a local (bubblewrap) sandbox; remembers every sandbox it was given."""

    manifest = Manifest(
        name="sleepy-shell",
        sandbox=SandboxSpec(backend="local", limits=Limits(memory_mb=512, pids=64), exec_timeout_s=60.0),
        sandbox_tools=("bash",),
        tool_timeout_s=60.0,
    )
    sandboxes: ClassVar[list] = []

    def reset(self, **row) -> str:
        SleepyShellEnv.sandboxes.append(self.sandbox)
        return "Run something."


def said_alpha(completions, **kwargs):
    return [float(any("alpha" in m["content"] for m in c if m["role"] == "tool")) for c in completions]


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        after_name = stat[stat.rfind(")") + 2 :].split()
        if after_name[0] in "ZX":
            continue
        table[int(entry.name)] = (int(after_name[1]), cmdline)
    return table


def sandbox_running(command: str, sandbox_pids: set[int]) -> int | None:
    """The pid of the sandbox (its bwrap process) in which `command` runs, or None."""
    table = process_table()
    for pid, (_, cmdline) in table.items():
        if cmdline != command:
            continue
        ancestor = pid
        while ancestor in table and ancestor > 1:
            if ancestor in sandbox_pids:
                return ancestor
            ancestor = table[ancestor][0]
    return None


async def bwrap_problem() -> str | None:
    """Why the local sandbox backend cannot run here (None when it can)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        async with create_sandbox(SandboxSpec(backend="local")) as sandbox:
            result = await sandbox.exec("true", timeout_s=10)
    except sandbox_errors.SandboxError as exc:
        return f"bubblewrap cannot start a sandbox here: {exc}"
    return None if result.exit_code == 0 else f"`true` exited {result.exit_code} in a local sandbox"


async def test_a_sandbox_killed_mid_tool_call_fails_only_its_rollout(tmp_path):
    """Three rollouts, each in its own bubblewrap sandbox; one runs `sleep` through the bash tool and its
    sandbox is SIGKILLed from outside meanwhile. That rollout fails typed SandboxDied and stays out of the
    group's rewards and advantages, the other two are trained, and every sandbox is gone afterwards."""
    problem = await bwrap_problem()
    if problem is not None:
        pytest.skip(problem)
    SleepyShellEnv.sandboxes = []
    first_turns = 0

    def script(prompt: str, call: int) -> str:
        nonlocal first_turns
        if "<tool_response>" in prompt:
            return "done"
        first_turns += 1
        command = {1: SLEEP_COMMAND, 2: "echo alpha"}.get(first_turns, "echo beta")
        return tool_call("bash", {"command": command})

    loop = make_loop(
        script,
        loop_cls=RecordingLoop,
        env=SleepyShellEnv,
        dataset=[{}],
        reward_funcs=[said_alpha],
        tmp_path=tmp_path,
        num_generations=3,
        max_concurrent_rollouts=3,
        **ONE_PASS,
    )
    killed: list[int] = []

    async def kill_the_sleeping_sandbox() -> None:
        while True:
            pids = {sb._process.pid for sb in SleepyShellEnv.sandboxes if sb._process is not None}
            victim = sandbox_running(SLEEP_COMMAND, pids)
            if victim is not None:
                os.killpg(victim, signal.SIGKILL)  # the sandbox's process group, as the OOM killer might
                killed.append(victim)
                return
            await anyio.sleep(0.02)

    started = time.monotonic()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(kill_the_sleeping_sandbox)
            (result,) = await run_groups(loop, 1)
    assert time.monotonic() - started < 30  # not the 37 s of the sleep: the kill ended the tool call
    assert len(killed) == 1

    rollouts = all_rollouts(loop)
    assert len(rollouts) == 3
    (dead,) = [rollout for rollout in rollouts if rollout.failed]
    assert dead.error_type == "SandboxDied"
    assert dead.error.startswith("tool bash: ") and "SandboxDied" in dead.error
    assert dead.completion == [] and dead.turns == []
    healthy = [rollout for rollout in rollouts if not rollout.failed]
    assert sorted(r.completion[1]["content"].split("\n")[0] for r in healthy) == ["alpha", "beta"]

    # kept out of the group's statistics: rewards 1 and 0 for the others, NaN for it; advantages about +-0.71
    (group,) = loop.groups
    rewards = group.rewards
    assert np.isnan(rewards).sum() == 1 and sorted(rewards[~np.isnan(rewards)]) == [0.0, 1.0]
    assert {sample.sequence.rollout_id for sample in result.samples} == {r.rollout_id for r in healthy}
    expected = 0.5 / (np.std([0.0, 1.0], ddof=1) + ADVANTAGE_EPS)  # ~0.707; [1, 0, 0] would give 1.15
    by_reward = {r.rollout_id: 1.0 if "alpha" in r.completion[1]["content"] else 0.0 for r in healthy}
    for sample in result.samples:
        sign = 1 if by_reward[sample.sequence.rollout_id] else -1
        assert sample.advantage == pytest.approx(sign * expected)
    summary = metrics(loop)
    assert summary["rollout/failed/SandboxDied_count"] == 1
    assert summary["rollout/failed_count"] == 1
    assert summary["reward"] == 0.5  # the mean over the two scored rollouts only

    # nothing left behind: every sandbox process reaped, every sandbox directory gone
    assert len(SleepyShellEnv.sandboxes) == 3
    for sandbox in SleepyShellEnv.sandboxes:
        assert sandbox.closed
        assert sandbox._process.returncode is not None
        with pytest.raises(ProcessLookupError):
            os.kill(sandbox._process.pid, 0)
        assert sandbox._dir is not None and not sandbox._dir.exists()
    assert not any(cmdline == SLEEP_COMMAND for _, cmdline in process_table().values())


class SlowStartShellEnv(Environment):
    """A shell whose sandboxes cannot start in time: what an engine under heavy load looks like."""

    manifest = Manifest(
        name="slow-start-shell",
        sandbox=SandboxSpec(backend="local", start_timeout_s=0.5),
        sandbox_tools=("bash",),
    )

    def reset(self, **row) -> str:
        return "Run something."


@pytest.mark.slow
async def test_sandbox_starts_that_time_out_fail_their_rollouts_typed_and_leave_nothing(
    tmp_path, monkeypatch
):
    """Every sandbox's executor is stuck (it sleeps instead of answering), so every start runs past its
    timeout: each rollout ends typed with the reason, counted by type, out of the rewards; the loop itself
    does not raise, and no sandbox directory or process is left."""
    problem = await bwrap_problem()
    if problem is not None:
        pytest.skip(problem)
    from sandboxes.local import sandbox_root
    from sandboxes.owner import owner_tag

    def mine() -> set[Path]:
        return set(sandbox_root().glob(f"{owner_tag()}-*")) if sandbox_root().exists() else set()

    before = mine()
    stuck = "import time; time.sleep(120)  # stuck-executor"
    monkeypatch.setattr("sandboxes.base.AGENT_SOURCE", stuck)
    loop = make_loop(
        lambda prompt, call: "unused",
        loop_cls=RecordingLoop,
        env=SlowStartShellEnv,
        dataset=[{}],
        reward_funcs=[random_reward],
        tmp_path=tmp_path,
        num_generations=4,
        max_concurrent_rollouts=4,
        **ONE_PASS,
    )
    with anyio.fail_after(60):
        await loop.run()  # one pass over one prompt, then it ends by itself
    rollouts = all_rollouts(loop)
    assert len(rollouts) == 4 and all(rollout.failed for rollout in rollouts)
    assert {rollout.error_type for rollout in rollouts} == {"SandboxTimeout"}
    assert all("no answer to 'ping' within 0.5 s" in rollout.error for rollout in rollouts)
    assert metrics(loop)["rollout/failed/SandboxTimeout_count"] == 4
    assert np.isnan(loop.groups[0].rewards).all()
    assert mine() <= before
    assert not any("stuck-executor" in cmdline for _, cmdline in process_table().values())


# --- 3 and 4. the real built-in server, failing and then gone ---------------------------------------------


@pytest.fixture
def builtin_server(tiny_model_dir, tmp_path):
    """The real built-in server on CPU, serving the tiny model; stopped (or found dead) after the test."""
    with start_builtin_server(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=512,
        timeout_s=180,
        log_path=tmp_path / "server.log",
    ) as server:
        yield server
    assert server.process.poll() is not None, "the built-in server outlived its test"


class FaultyProxy:
    """An HTTP proxy to the real server that answers 500 to the first `fail_first` /v1/completions."""

    def __init__(self, upstream: str, fail_first: int):
        self.upstream = upstream
        self.fail_first = fail_first
        self.injected = 0
        self.forwarded_completions = 0

    async def handle(self, request):
        from aiohttp import web

        if request.path == "/v1/completions" and self.injected < self.fail_first:
            self.injected += 1
            await request.read()
            return web.json_response(
                {"error": {"message": "injected fault", "type": "InternalServerError", "code": 500}},
                status=500,
            )
        if request.path == "/v1/completions":
            self.forwarded_completions += 1
        body = await request.read()
        async with self.session.request(
            request.method, f"{self.upstream}{request.path_qs}", data=body, headers=_forwardable(request)
        ) as upstream:
            payload = await upstream.read()
            return web.Response(
                body=payload, status=upstream.status, content_type=upstream.content_type or None
            )

    async def __aenter__(self) -> str:
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc_info) -> None:
        await self.runner.cleanup()
        await self.session.close()


def _forwardable(request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}


def server_loop(url: str, tmp_path: Path, **config) -> tuple[RecordingLoop, GenerationClient]:
    """A loop on prompt rows, generating through a real GenerationClient with fast retries."""
    client = GenerationClient(
        url, timeout_s=30, max_concurrency=8, max_retries=2, retry_backoff_s=0.02, retry_backoff_max_s=0.05
    )
    settings = dict(num_generations=4, max_completion_length=6, max_concurrent_rollouts=4, temperature=1.0)
    settings.update(config)
    loop = make_loop(
        None,
        loop_cls=RecordingLoop,
        dataset=prompt_rows("ab", "cd", "ef", "gh"),
        reward_funcs=[random_reward],
        tmp_path=tmp_path,
        **settings,
    )
    loop.client = client  # the real client instead of the double make_loop built
    return loop, client


async def test_server_errors_are_retried_and_the_loop_recovers(builtin_server, tmp_path):
    """10 injected 500s on a client with 2 retries: at least two rollouts of the first group exhaust their
    3 attempts (10 > 4 x 2), each retry is counted, and every group after the first trains on all four."""
    fail_first = 10
    proxy = FaultyProxy(builtin_server.base_url, fail_first)
    async with proxy as url:
        loop, client = server_loop(url, tmp_path, **ONE_PASS)  # four prompts, four groups, then it ends
        async with client:
            results = await run_groups(loop, 4)
    assert proxy.injected == fail_first
    assert len(loop.groups) == 4 and len(results) == 4
    summary = metrics(loop)
    rollouts = all_rollouts(loop)
    failed = [rollout for rollout in rollouts if rollout.failed]
    # max_concurrent_rollouts == num_generations: one group at a time, so the first group took every fault
    first_group = loop.groups[0]
    assert all(rollout in first_group.rollouts for rollout in failed)
    assert 2 <= len(failed) <= 3
    assert {rollout.error_type for rollout in failed} == {"ServerUnavailableError"}
    assert all("failed after 3 attempts" in rollout.error for rollout in failed)
    # every injected fault is either a counted retry or the last attempt of a failed rollout
    assert summary["rollout/vllm_retry_count"] == fail_first - len(failed)
    assert summary["rollout/failed/ServerUnavailableError_count"] == len(failed)
    assert summary["rollout/failed_count"] == len(failed)
    # the loop recovered: later groups have no failure and all their rollouts are trained
    by_position = sorted(results, key=lambda result: result.position)
    for result in by_position[1:]:
        assert len({s.sequence.rollout_id for s in result.samples}) == 4
    assert sum(not rollout.failed for rollout in rollouts) == len(rollouts) - len(failed)


async def test_a_server_that_goes_away_trips_the_breaker_with_a_clear_message(builtin_server, tmp_path):
    """The real server is SIGKILLed after two groups: every request then fails to connect, each rollout
    fails typed ServerUnavailableError after its retries, and the breaker (more than half of the last 8
    failed) stops the run with a message naming the type, within seconds, instead of hanging."""
    loop, client = server_loop(builtin_server.base_url, tmp_path, failure_window=8, max_failure_frac=0.5)
    loop.stop_event = None
    groups_before_kill = 2

    async def kill_server_after_some_groups() -> None:
        while loop.rollout_buffer.qsize() < groups_before_kill:
            await anyio.sleep(0.02)
        builtin_server.process.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(builtin_server.process.wait)

    started = time.monotonic()
    with pytest.raises(ExceptionGroup) as raised:
        with anyio.fail_after(90):
            async with client, anyio.create_task_group() as group:
                group.start_soon(kill_server_after_some_groups)
                await loop.run()
    elapsed = time.monotonic() - started
    # Rollouts that end in the same instant as the one that tripped the breaker may trip it too: every
    # error is the breaker's, naming the failure type and the settings to change.
    errors = _leaves(raised.value)
    assert errors and all(type(error).__name__ == "RolloutFailureRate" for error in errors), errors
    for error in errors:
        message = str(error)
        assert re.search(r"^\d of the last 8 rollouts failed \(ServerUnavailableError x\d\)", message)
        assert "max_failure_frac / failure_window" in message
    assert elapsed < 60
    assert builtin_server.process.poll() is not None
    rollouts = all_rollouts(loop)  # scored groups: from before the kill, and possibly one straddling it
    assert loop.rollout_buffer.qsize() >= groups_before_kill
    assert all(rollout.error_type in (None, "ServerUnavailableError") for rollout in rollouts)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside nested exception groups (the loop's task groups wrap what rollouts raised)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [] if isinstance(exc, asyncio.CancelledError) else [exc]


def test_a_worker_failure_names_its_root_causes_first_and_last():
    from harness.rollout.worker import describe_failure

    async def fail() -> None:
        async def bad(text: str) -> None:
            raise ValueError(text)

        async with anyio.create_task_group() as group:
            group.start_soon(bad, "the sandbox engine went away")
            group.start_soon(bad, "and another")

    with pytest.raises(BaseExceptionGroup) as info:
        anyio.run(fail)
    text = describe_failure(info.value)
    first_lines, last_lines = text.splitlines()[:2], text.splitlines()[-2:]
    expected = ["  caused by ValueError: the sandbox engine went away", "  caused by ValueError: and another"]
    assert first_lines == expected and last_lines == expected
    assert "Traceback" in text

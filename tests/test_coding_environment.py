"""The python-coding environment: references pass their own hidden tests in a real sandbox, an episode
through the real tools is graded in a fresh sandbox, and hostile solutions score what they earn while
nothing leaks. Runs on Docker when an engine with the image answers (CI), bubblewrap otherwise."""

from __future__ import annotations

import textwrap

import pytest

from environments import environment_tools, load, validate_environment
from environments.coding import CodingEnv
from environments.coding.grader import expected_outputs, grade
from environments.coding.tasks import TASKS, check_tasks
from sandboxes import create_sandbox
from tools import ToolCall, ToolExecutor

pytestmark = pytest.mark.anyio
TASK = next(task for task in TASKS if task.name == "run_length_encode")
SPEC = CodingEnv.manifest.sandbox


@pytest.fixture
def anyio_backend():
    return "asyncio"


def with_reference(extra: str = "", *, body_prefix: str = "") -> str:
    """The reference solution of TASK, with code of a hostile solution added around it."""
    return (
        textwrap.dedent(extra)
        + "\n"
        + TASK.reference.replace(f"{TASK.signature}\n", f"{TASK.signature}\n{body_prefix}", 1)
    )


def test_the_task_set_is_consistent():
    check_tasks()
    assert len(TASKS) >= 48
    assert expected_outputs(TASK)[:2] == ([], [["a", 1]])


@pytest.mark.slow
async def test_every_reference_solution_passes_its_hidden_tests():
    failures = {}
    async with create_sandbox(SPEC) as sandbox:
        for task in TASKS:
            job = await grade_in(sandbox, task)
            if job != 1.0:
                failures[task.name] = job
    assert failures == {}


async def grade_in(sandbox, task) -> float:
    """Grade a task's reference inside an existing sandbox (one sandbox for all 50)."""
    from environments.coding import grader

    return (await grader.grade_in(sandbox, task, task.reference, case_timeout_s=10.0)).fraction


async def test_an_episode_through_the_tools_is_graded_in_a_fresh_sandbox():
    cls = load("python-coding")
    manifest = validate_environment(cls)
    async with create_sandbox(manifest.sandbox) as sandbox:
        env = cls()
        env.sandbox = sandbox
        prompt = env.reset(task=TASK.name)
        assert TASK.signature in prompt and "solution.py" in prompt
        toolset = environment_tools(env, manifest)
        assert toolset.names() == ["write_file", "python", "bash"]
        with ToolExecutor() as executor:
            wrote = await executor.run_one(
                ToolCall("write_file", {"path": "solution.py", "content": TASK.reference}), toolset
            )
            tried = await executor.run_one(
                ToolCall("python", {"code": "from solution import run_length_encode as f; print(f('aab'))"}),
                toolset,
            )
        assert wrote.ok and tried.content == "[['a', 2], ['b', 1]]"
        assert await env.get_reward() == 1.0
        assert env.last_grade.passed == len(TASK.cases)
        # A wrong solution in the policy's sandbox scores 0; a missing one too.
        await sandbox.write_file("solution.py", "def run_length_encode(text):\n    return []\n")
        assert 0.0 < await env.get_reward() < 0.5  # only the empty-input case happens to pass
        await sandbox.exec("rm solution.py")
        assert await env.get_reward() == 0.0
        assert env.last_grade.errors == ["no solution.py was written"]


DELETE_EVERYTHING = """
import shutil
for path in ("/workspace", "/tmp", "."):
    shutil.rmtree(path, ignore_errors=True)
"""
PRINT_A_GIGABYTE = """
import sys
chunk = b"x" * (1 << 26)
for _ in range(16):
    sys.stdout.buffer.write(chunk)
"""
FLOOD_DESCRIPTORS = """
import os
for fd in range(1, 10):
    try:
        os.write(fd, b'{"ok": true, "value": 1}' * 1000)
    except OSError:
        pass
"""
FORK_FOREVER = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
FORGE_THE_EXECUTOR = r"""
import json, os, struct
answer = {"ok": True, "exit_code": 0, "timed_out": False, "stdout_truncated": False,
          "stderr_truncated": False, "duration_s": 0.0, "stderr": "",
          "stdout": "eyJwYXNzZWQiOiA5LCAidG90YWwiOiA5LCAicmVzdWx0cyI6IFtdfQ=="}
for path in ("/proc/1/fd/1", f"/proc/{os.getppid()}/fd/1"):
    try:
        with open(path, "wb", buffering=0) as stream:
            for request_id in range(1, 500):
                body = json.dumps({**answer, "id": request_id}).encode()
                stream.write(struct.pack(">I", len(body)) + body)
    except OSError:
        pass
"""
FAKE_OWN_RESULT = """
import json, os
for fd in range(3, 30):
    try:
        os.write(fd, json.dumps({"ok": True, "value": "forged"}).encode() + b"\n")
    except OSError:
        pass
os._exit(0)
"""
EXIT_EARLY = "import os\nos._exit(0)\n"
FAKE_VERDICTS = """
import os
for fd in range(0, 30):
    try:
        os.write(fd, b'{"passed": 9, "total": 9, "results": [{"passed": true}]}\\n')
    except OSError:
        pass
"""
PATCH_BUILTINS = """
import builtins, json
builtins.isinstance = lambda *args: True
json.dumps = lambda *args, **kwargs: '{"ok": true, "value": []}'
"""
ATTACK_THE_GRADER = """
import ctypes, os, signal
libc = ctypes.CDLL(None)
for pid in (1, os.getppid()):
    libc.ptrace(16, pid, 0, 0)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
"""
TRY_THE_NETWORK = (
    "    import urllib.request\n    urllib.request.urlopen('http://deb.debian.org', timeout=2)\n"
)

# case -> (code before the function, code at the start of its body, expected reward)
HOSTILE = {
    "deletes the tests and answers wrongly": (DELETE_EVERYTHING, "    return 'wrong'\n", 0.0),
    "deletes everything it can but answers right": (DELETE_EVERYTHING, "", 1.0),
    "loops forever": ("", "    while True:\n        pass\n", 0.0),
    "prints a gigabyte, then answers right": (PRINT_A_GIGABYTE, "", 1.0),
    "floods every descriptor with garbage": (FLOOD_DESCRIPTORS, "", 0.0),
    "tries the network": ("", TRY_THE_NETWORK, 0.0),
    "forks without end": (FORK_FOREVER, "", 0.0),
    "forges the executor's answers, answers wrongly": (FORGE_THE_EXECUTOR, "    return 'wrong'\n", 0.0),
    "forges the executor's answers, answers right": (FORGE_THE_EXECUTOR, "", 1.0),
    "writes a passing result for itself and exits": (FAKE_OWN_RESULT, "", 0.0),
    "exits 0 before answering": (EXIT_EARLY, "", 0.0),
    "prints fake verdicts everywhere": (FAKE_VERDICTS, "    return 'wrong'\n", 0.0),
    # its answer is [] for every input (json.dumps patched): it earns the cases whose answer is []
    "monkeypatches builtins and json": (PATCH_BUILTINS, "", "the cases answered []"),
    "traces and signals the grader": (ATTACK_THE_GRADER, "    return 'wrong'\n", 0.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HOSTILE), ids=lambda case: case.replace(" ", "-"))
async def test_hostile_solutions_score_what_they_earn_and_leak_nothing(case):
    prelude, body_prefix, expected = HOSTILE[case]
    if expected == "the cases answered []":
        expected = sum(output == [] for output in expected_outputs(TASK)) / len(TASK.cases)
        assert 0 < expected < 1
    before = sandbox_leftovers()
    source = with_reference(prelude, body_prefix=body_prefix)
    result = await grade(TASK, source, SPEC, case_timeout_s=3.0 if expected else 1.0)
    assert result.fraction == expected, result.errors
    assert sandbox_leftovers() == before


def sandbox_leftovers() -> set[str]:
    """Sandbox containers and local sandbox directories that exist right now."""
    from sandboxes.local import sandbox_root

    found = {str(path) for path in sandbox_root().glob("*")} if sandbox_root().exists() else set()
    try:
        from sandboxes.engine import LABELS, docker_client

        found |= {
            c["Id"] for c in docker_client().api.containers(all=True, filters={"label": LABELS["managed"]})
        }
    except Exception:  # no engine: only local sandboxes can exist
        pass
    return found

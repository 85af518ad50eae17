"""The built-in sandbox tools, run through the executor on a real (bubblewrap) sandbox."""

from __future__ import annotations

import pytest

from sandboxes.backends import create_sandbox
from sandboxes.base import ExecResult, SandboxSpec
from tools import ToolCall, ToolExecutor, ToolStatus
from tools.sandboxed import SandboxTools, format_result

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def toolset():
    async with create_sandbox(SandboxSpec(backend="local")) as sandbox:
        yield SandboxTools(sandbox, timeout_s=2.0, max_output_chars=2000).toolset()


async def call(toolset, name: str, **arguments):
    with ToolExecutor(max_workers=4) as executor:
        return await executor.run_one(ToolCall(name, arguments), toolset)


async def test_the_six_tools_have_schemas(toolset):
    assert toolset.names() == ["bash", "python", "read_file", "write_file", "edit", "list_dir"]
    assert toolset["edit"].parameters["required"] == ["path", "old", "new"]


async def test_write_edit_read_and_run(toolset):
    wrote = await call(toolset, "write_file", path="src/app.py", content="def f():\n    return 1\n")
    assert wrote.status is ToolStatus.OK and wrote.content == "wrote 22 bytes to src/app.py"
    edited = await call(toolset, "edit", path="src/app.py", old="return 1", new="return 41 + 1")
    assert edited.status is ToolStatus.OK
    assert (await call(toolset, "read_file", path="src/app.py")).content == "def f():\n    return 41 + 1\n"
    ran = await call(
        toolset, "python", code="import sys; sys.path.insert(0, 'src'); import app; print(app.f())"
    )
    assert ran.content == "42"
    listing = await call(toolset, "list_dir", path=".")
    assert listing.content == "src/\n"


async def test_failures_are_answers_the_model_can_act_on(toolset):
    failed = await call(toolset, "bash", command="echo out; echo err >&2; exit 4")
    assert failed.status is ToolStatus.OK
    assert failed.content == "out\n[stderr]\nerr\n[exit code 4]"
    slow = await call(toolset, "bash", command="sleep 30")
    assert slow.status is ToolStatus.OK and "timed out after 2.0 s and was killed" in slow.content
    missing = await call(toolset, "edit", path="nope.txt", old="a", new="b")
    assert missing.status is ToolStatus.ERROR and "nope.txt" in missing.content
    await call(toolset, "write_file", path="twice.txt", content="x x")
    ambiguous = await call(toolset, "edit", path="twice.txt", old="x", new="y")
    assert ambiguous.status is ToolStatus.ERROR and "occurs 2 times" in ambiguous.content
    no_dir = await call(toolset, "list_dir", path="nowhere")
    assert no_dir.status is ToolStatus.ERROR and "nowhere" in no_dir.content


async def test_output_is_capped_by_the_executor(toolset):
    result = await call(toolset, "bash", command="seq 1 100000")
    assert result.truncated and len(result.content) <= 2000
    assert result.content.startswith("1\n2\n3\n") and "characters truncated" in result.content


def test_format_result_notes():
    def result(**fields) -> ExecResult:
        base = dict(
            exit_code=0,
            stdout="",
            stderr="",
            timed_out=False,
            stdout_truncated=False,
            stderr_truncated=False,
            duration_s=0.1,
        )
        return ExecResult(**{**base, **fields})

    assert format_result(result()) == "(no output)"
    assert format_result(result(stdout="a\n")) == "a"
    assert (
        format_result(result(stdout="a", stdout_truncated=True, exit_code=1))
        == "a\n[exit code 1; output truncated]"
    )

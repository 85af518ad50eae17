"""The grading runner: executed inside a fresh grading sandbox with `python3 -c`, never imported.

It reads one job from stdin (the solution's source, the function name, the hidden test inputs and their
expected outputs, a per-test timeout), runs each test in a child process of its own, compares the value
the child returns with the expected one, and prints a JSON summary on stdout.

Why it is built this way (the solution is untrusted, model-written code):
- expected outputs stay in this process; the child that runs the solution never sees them, and this
  process marks itself non-dumpable so the child cannot read its memory or its stdin through /proc;
- the child writes its result on a private copy of its stdout, after pointing fd 1 at /dev/null, so
  what the solution prints (even gigabytes) never mixes with the result, and at most MAX_RESULT_BYTES
  of it are read anyway;
- each test gets a fresh directory with a fresh copy of solution.py, so a solution that deletes or
  rewrites files cannot affect the next test;
- each child runs in its own process group, killed after its test: a loop ends at the timeout, a fork
  bomb's processes go with it (the sandbox's pids limit caps it meanwhile).
Standard library only; Python 3.10 or later.
"""

import contextlib
import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

MAX_RESULT_BYTES = 1 << 20

CHILD = r"""
import json, os, sys
result_fd = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
os.dup2(1, 2)
request = json.loads(sys.stdin.read())
try:
    import importlib.util
    spec = importlib.util.spec_from_file_location("solution", "solution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    value = getattr(module, request["function"])(*request["args"])
    outcome = {"ok": True, "value": value}
except BaseException as exc:
    outcome = {"ok": False, "error": (type(exc).__name__ + ": " + str(exc))[:300]}
try:
    data = json.dumps(outcome)
except (TypeError, ValueError):
    data = json.dumps({"ok": False, "error": "the return value is not JSON-serialisable"})
os.write(result_fd, data.encode())
os._exit(0)
"""


def main():
    _make_undumpable()
    job = json.loads(sys.stdin.read())
    results = []
    for args, expected in zip(job["cases"], job["expected"], strict=False):
        outcome = _run_case(job["source"], job["function"], args, job["timeout_s"])
        if outcome.get("ok") and _same(outcome["value"], expected, job.get("compare", "exact")):
            results.append({"passed": True})
        else:
            results.append({"passed": False, "error": outcome.get("error", "wrong answer")})
    passed = sum(result["passed"] for result in results)
    print(json.dumps({"passed": passed, "total": len(results), "results": results}))


def _run_case(source, function, args, timeout_s):
    directory = tempfile.mkdtemp(prefix="case-")
    try:
        with open(os.path.join(directory, "solution.py"), "w") as f:
            f.write(source)
        try:
            child = subprocess.Popen(
                [sys.executable, "-I", "-c", CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=directory,
                start_new_session=True,
            )
        except OSError as exc:
            return {"ok": False, "error": "could not start the test: " + str(exc)}
        timer = threading.Timer(timeout_s, _kill_group, (child.pid,))
        timer.start()
        try:
            try:
                child.stdin.write(json.dumps({"function": function, "args": args}).encode())
                child.stdin.close()
            except OSError:
                pass
            data = child.stdout.read(MAX_RESULT_BYTES)
        finally:
            timed_out = not timer.is_alive()
            timer.cancel()
            _kill_group(child.pid)
            child.wait()
        if timed_out:
            return {"ok": False, "error": f"timed out after {timeout_s:g} s"}
        try:
            return json.loads(data)
        except ValueError:
            return {"ok": False, "error": "the test process gave no result (it exited or was killed)"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _same(value, expected, compare):
    if compare == "float":
        return _close(value, expected)
    if compare == "unordered":
        if not isinstance(value, list) or not isinstance(expected, list):
            return False
        key = lambda item: json.dumps(item, sort_keys=True)  # noqa: E731
        return sorted(value, key=key) == sorted(expected, key=key)
    return _equal(value, expected)


def _equal(value, expected):
    """JSON-value equality where booleans are not numbers and 2 equals 2.0."""
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(expected, (int, float)):
        return isinstance(value, (int, float)) and value == expected
    if isinstance(expected, list):
        return isinstance(value, list) and len(value) == len(expected) and all(map(_equal, value, expected))
    if isinstance(expected, dict):
        return (
            isinstance(value, dict)
            and value.keys() == expected.keys()
            and all(_equal(value[key], expected[key]) for key in expected)
        )
    return type(value) is type(expected) and value == expected


def _close(value, expected):
    if isinstance(expected, list):
        return isinstance(value, list) and len(value) == len(expected) and all(map(_close, value, expected))
    if isinstance(expected, dict):
        return (
            isinstance(value, dict)
            and value.keys() == expected.keys()
            and all(_close(value[k], expected[k]) for k in expected)
        )
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-9)
    return value == expected


def _kill_group(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _make_undumpable():
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)


if __name__ == "__main__":
    main()

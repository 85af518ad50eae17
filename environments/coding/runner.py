"""One hidden test of a coding task: executed inside the grading sandbox with `python3 -I -c`, never imported.

It reads {"function": name, "args": [...]} from stdin, imports solution.py from its working directory,
calls the function, and writes one JSON line, {"ok": true, "value": ...} or {"ok": false, "error": ...},
to a private copy of its stdout. Before the solution is imported, fd 1 and fd 2 point at /dev/null, so what
the solution prints never mixes with the result.

This process runs the solution's code, so nothing here is trusted: the verdict is decided by the grader
on the host (grader.py), which never sends the expected outputs into the sandbox and accepts exactly one
JSON object as the result. A solution that forges a result, exits early, floods its output or breaks
this process only fails its own test. Standard library only; Python 3.8 or later.
"""

import json
import os
import sys

result_fd = os.dup(1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
request = json.loads(sys.stdin.read())
try:
    import importlib.util

    spec = importlib.util.spec_from_file_location("solution", "solution.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    outcome = {"ok": True, "value": getattr(module, request["function"])(*request["args"])}
except BaseException as exc:  # the solution's failure, whatever it is, is its test's result
    outcome = {"ok": False, "error": (type(exc).__name__ + ": " + str(exc))[:300]}
try:
    data = json.dumps(outcome)
except (TypeError, ValueError):
    data = json.dumps({"ok": False, "error": "the return value is not JSON-serialisable"})
os.write(result_fd, data.encode() + b"\n")
os._exit(0)

"""The resident executor that runs inside every sandbox and does its work on request.

Starting a process through a container engine costs tens of milliseconds; a round trip to a process that
is already running inside costs a fraction of one. So each sandbox starts this program once (as the
container's main process, or inside the bubblewrap namespaces) and the host sends it requests over its
stdin and reads the answers from its stdout. It runs each command with a timeout, kills the command's whole
process tree when the timeout passes, caps the output it keeps, and reads and writes files.

It is one self-contained file of standard-library Python (3.8 or later), because it is passed to the
sandbox's own interpreter with `python3 -c`: nothing of the host is imported, nothing is installed.

Protocol: every message, both ways, is a 4-byte big-endian length followed by that many bytes of JSON.
A request is {"id": int, "op": str, ...}; its answer is {"id": int, "ok": true, ...} or
{"id": int, "ok": false, "error": <exception class name>, "message": str}. Requests are handled
concurrently, each on its own thread, so answers may come back out of order. Binary data travels as
base64. End of input means the host is gone: the executor kills every command it started and exits.

Operations:
    ping                                  -> {pid, uid}
    exec {argv, stdin?, env?, cwd?, timeout_s?, max_output_bytes?, cpu_s?}
        -> {exit_code, stdout, stderr, timed_out, stdout_truncated, stderr_truncated, duration_s}
    read_file {path, max_bytes}           -> {data}
    write_file {path, data, mode?}        -> {}
    put_archive {path, data}              -> {} (a tar extracted safely under path)
    get_archive {path, max_bytes}         -> {data} (a tar of path)
    kill_all                              -> {killed} (every process in the sandbox but this one)

When a command ends, what it left running in its process group (`cmd &`) is killed; a service started
with `setsid` (or a double fork) is left running. When a command times out, its process group, its
descendants and every process carrying its marker variable (set in each command's environment, so
detached processes keep it) are killed. Only a process that clears its environment and detaches escapes
that; closing the sandbox ends it too.

Code running in the sandbox runs as the same user as this executor (so starting a command stays on the
cheap vfork path): it can kill the executor, which the host then sees as a dead sandbox. The executor marks
itself non-dumpable, so that code cannot open its pipes through /proc or attach a debugger to it.
"""

import base64
import contextlib
import ctypes
import io
import json
import os
import queue
import resource
import selectors
import signal
import struct
import subprocess
import sys
import tarfile
import threading
import time

HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 1 << 30
EXIT_GRACE_S = 0.2
MARKER_VARIABLE = "HARNESS_EXEC"  # how long output may keep arriving after the command itself exited
READ_CHUNK = 1 << 16
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONUNBUFFERED": "1",
}

_write_lock = threading.Lock()
_children_lock = threading.Lock()
_children: "set[int]" = set()  # process group ids of running commands
_jobs: "queue.SimpleQueue[dict]" = queue.SimpleQueue()
_workers_lock = threading.Lock()
_idle_workers = 0
_workdir = "/"


def main(argv):
    global _workdir
    config = json.loads(argv[1]) if len(argv) > 1 else {}
    _workdir = config.get("workdir") or os.getcwd()
    BASE_ENV["HOME"] = _workdir
    BASE_ENV.update(config.get("env") or {})
    _apply_rlimits(config.get("rlimits") or {})
    _make_undumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = _read_exactly(stdin, HEADER.size)
        if header is None:
            break
        (length,) = HEADER.unpack(header)
        if length > MAX_MESSAGE_BYTES:
            break
        body = _read_exactly(stdin, length)
        if body is None:
            break
        request = json.loads(body)
        if request.get("op") == "ping":
            _answer(stdout, request, {"pid": os.getpid(), "uid": os.getuid()})
            continue
        _dispatch(stdout, request)
    _kill_all_children()


def _dispatch(stdout, request):
    """Hand a request to an idle worker thread, or to a new one (threads are kept: starting one per
    request would cost more than a trivial command)."""
    global _idle_workers
    with _workers_lock:
        if _idle_workers:
            _idle_workers -= 1
            _jobs.put(request)
            return
    try:
        threading.Thread(target=_work, args=(stdout, request), daemon=True).start()
    except RuntimeError:  # no thread to be had (the process limit is reached): answer inline
        _handle(stdout, request)


def _work(stdout, request):
    global _idle_workers
    while True:
        _handle(stdout, request)
        with _workers_lock:
            _idle_workers += 1
        request = _jobs.get()


def _handle(stdout, request):
    op = OPERATIONS.get(request.get("op"))
    try:
        if op is None:
            raise ValueError(f"unknown operation {request.get('op')!r}")
        result = op(request)
    except Exception as exc:  # every failure goes back to the host, typed by class name
        _send(
            stdout, {"id": request.get("id"), "ok": False, "error": type(exc).__name__, "message": str(exc)}
        )
        return
    _answer(stdout, request, result)


def _answer(stdout, request, result):
    result["id"] = request.get("id")
    result["ok"] = True
    _send(stdout, result)


def _send(stdout, message):
    data = json.dumps(message, separators=(",", ":")).encode()
    with _write_lock:
        stdout.write(HEADER.pack(len(data)) + data)
        stdout.flush()


def _read_exactly(stream, size):
    chunks = []
    while size:
        chunk = stream.read(size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# --- exec ---------------------------------------------------------------------------------------------


def op_exec(request):
    argv = request["argv"]
    env = dict(BASE_ENV)
    env.update(request.get("env") or {})
    # Every process of this command inherits the marker, even one that leaves its process group and its
    # parent (setsid, a double fork), so a timeout can still find it.
    marker = f"{os.getpid()}-{request.get('id') or 0}"
    env[MARKER_VARIABLE] = marker
    stdin_data = _b64decode(request.get("stdin"))
    timeout_s = request.get("timeout_s")
    cap = int(request.get("max_output_bytes") or (1 << 20))
    cwd = _resolve(request["cwd"]) if request.get("cwd") else _workdir
    if not os.path.isdir(cwd):
        raise NotADirectoryError(f"working directory {request['cwd']} does not exist")
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own process group, so a timeout can kill the whole tree
        )
    except FileNotFoundError as exc:
        return _exec_result(127, b"", (f"{argv[0]}: command not found ({exc.strerror})").encode(), started)
    except PermissionError as exc:
        return _exec_result(126, b"", (f"{argv[0]}: permission denied ({exc.strerror})").encode(), started)
    except OSError as exc:  # EAGAIN when the sandbox's process limit is reached, ENOMEM, ...
        return _exec_result(126, b"", (f"{argv[0]}: could not start: {exc}").encode(), started)
    with _children_lock:
        _children.add(proc.pid)
    try:
        if request.get("cpu_s"):
            cpu = int(request["cpu_s"])
            resource.prlimit(proc.pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        if stdin_data is not None:
            threading.Thread(target=_feed, args=(proc.stdin, stdin_data), daemon=True).start()
        deadline = started + timeout_s if timeout_s else None
        outputs, timed_out = _collect(proc, deadline, cap)
        if not timed_out:
            try:
                proc.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:  # closed its output but kept running
                timed_out = True
        if timed_out:
            _kill_tree(proc.pid, marker)
        else:
            _kill_group(proc.pid)  # what it left running in the background; `setsid` keeps a service
        proc.wait()
    finally:
        with _children_lock:
            _children.discard(proc.pid)
    (out, out_dropped), (err, err_dropped) = outputs
    result = _exec_result(proc.returncode, bytes(out), bytes(err), started)
    result.update(timed_out=timed_out, stdout_truncated=out_dropped > 0, stderr_truncated=err_dropped > 0)
    return result


def _exec_result(exit_code, out, err, started):
    return {
        "exit_code": exit_code,
        "stdout": base64.b64encode(out).decode(),
        "stderr": base64.b64encode(err).decode(),
        "timed_out": False,
        "stdout_truncated": False,
        "stderr_truncated": False,
        "duration_s": time.monotonic() - started,
    }


def _feed(pipe, data):
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


def _collect(proc, deadline, cap):
    """Read stdout and stderr until both close (or the command exits and EXIT_GRACE_S passes), keeping the
    first `cap` bytes of each and discarding the rest, so huge output costs time but not memory."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    dropped = dict.fromkeys(buffers, 0)
    order = list(buffers)
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    exited_at = None
    timed_out = False
    try:
        while selector.get_map():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at >= EXIT_GRACE_S:
                break  # a background child holds the pipes open: stop reading, leave it be
            wait = 0.05 if exited_at is None else EXIT_GRACE_S - (now - exited_at)
            if deadline is not None:
                wait = min(wait, deadline - now)
            for key, _ in selector.select(max(wait, 0)):
                try:
                    chunk = os.read(key.fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = cap - len(buffer)
                if room > 0:
                    buffer += chunk[:room]
                dropped[key.fd] += max(len(chunk) - max(room, 0), 0)
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    return [(buffers[fd], dropped[fd]) for fd in order], timed_out


def _kill_tree(pid, marker=None):
    """SIGKILL a command's process group, every descendant that left it, and every process carrying its
    marker (one that detached from its parent too); a few rounds, for processes forked meanwhile."""
    for _ in range(3):
        victims = _descendants(pid) | (_marked(marker) if marker else set())
        _kill_group(pid)
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
        if not victims:
            return


def _kill_group(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _proc_files(name):
    """(pid, contents of /proc/PID/NAME) for every process this one may read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/{name}", "rb") as f:
                    yield int(entry), f.read()
            except OSError:
                continue


def _parent(stat):
    # the fields after the parenthesised command name: state, then ppid
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def _marked(marker):
    needle = (f"{MARKER_VARIABLE}={marker}\0").encode()
    return {
        pid
        for pid, environ in _proc_files("environ")
        if environ.startswith(needle) or b"\0" + needle in environ
    }


def _descendants(root):
    parents = {pid: _parent(stat) for pid, stat in _proc_files("stat")}
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found |= frontier
    return found


def op_kill_all(request):
    """Kill every process in the sandbox but this executor and its ancestors (used to recycle it)."""
    parents = {pid: _parent(stat) for pid, stat in _proc_files("stat")}
    keep, pid = {1}, os.getpid()
    while pid in parents and pid not in keep:
        keep.add(pid)
        pid = parents[pid]
    killed = 0
    for pid in parents:
        if pid not in keep:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return {"killed": killed}


def _kill_all_children():
    with _children_lock:
        groups = list(_children)
    for group in groups:
        _kill_tree(group)


# --- files --------------------------------------------------------------------------------------------


def op_read_file(request):
    path = _resolve(request["path"])
    max_bytes = int(request.get("max_bytes") or (64 << 20))
    size = os.path.getsize(path)
    if size > max_bytes:
        raise OverflowError(f"{request['path']} is {size} bytes; the limit is {max_bytes}")
    with open(path, "rb") as f:
        return {"data": base64.b64encode(f.read(max_bytes)).decode()}


def op_write_file(request):
    path = _resolve(request["path"])
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "wb") as f:
        f.write(_b64decode(request.get("data")) or b"")
    if request.get("mode") is not None:
        os.chmod(path, int(request["mode"]))
    return {}


def op_put_archive(request):
    target = _resolve(request["path"])
    os.makedirs(target, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(_b64decode(request["data"])), mode="r:*") as archive:
        members = [m for m in archive.getmembers() if _safe_member(m, target)]
        archive.extractall(target, members=members)
    return {}


def op_get_archive(request):
    source = _resolve(request["path"])
    if not os.path.exists(source):
        raise FileNotFoundError(f"{request['path']} does not exist")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(source, arcname=".")
    data = buffer.getvalue()
    max_bytes = int(request.get("max_bytes") or (256 << 20))
    if len(data) > max_bytes:
        raise OverflowError(f"archive of {request['path']} is {len(data)} bytes; the limit is {max_bytes}")
    return {"data": base64.b64encode(data).decode()}


def _safe_member(member, target):
    """Regular files and directories whose path stays inside `target`; links and devices are skipped."""
    if not (member.isfile() or member.isdir()):
        return False
    path = os.path.realpath(os.path.join(target, member.name))
    return path == target or path.startswith(target.rstrip("/") + "/")


def _resolve(path):
    return os.path.realpath(os.path.join(_workdir, path))


def _b64decode(text):
    return None if text is None else base64.b64decode(text)


# --- process setup ------------------------------------------------------------------------------------


def _apply_rlimits(limits):
    names = {"as": "RLIMIT_AS", "nproc": "RLIMIT_NPROC", "fsize": "RLIMIT_FSIZE", "nofile": "RLIMIT_NOFILE"}
    for key, value in limits.items():
        limit = getattr(resource, names[key])
        resource.setrlimit(limit, (int(value), int(value)))


def _make_undumpable():
    """PR_SET_DUMPABLE 0: same-user processes can no longer ptrace this one or open its /proc files."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


OPERATIONS = {
    "exec": op_exec,
    "read_file": op_read_file,
    "write_file": op_write_file,
    "put_archive": op_put_archive,
    "get_archive": op_get_archive,
    "kill_all": op_kill_all,
}

if __name__ == "__main__":
    main(sys.argv)

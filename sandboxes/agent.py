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

The request stream is the one channel the sandbox's code must never reach: a forged answer would be a
forged result (an exit code, a test verdict). So the executor runs as the sandbox's pid 1 (the container's
main process, or bwrap --as-pid-1): the kernel ignores signals sent to a pid namespace's init from inside
it, so commands cannot kill or stop it, and no other process in the sandbox holds the stream. It marks
itself non-dumpable, so commands cannot open its pipes through /proc/1/fd, read its memory or attach a
debugger. Where the backend can give it one (Docker: `command_user`), commands run as another uid, with
no capabilities, and file operations act with that uid's rights (a per-thread fsuid), so nothing the
executor may do as root is reachable through them. As pid 1 it also reaps the orphans commands leave.
Frames are capped at MAX_MESSAGE_BYTES both ways.
"""

import base64
import contextlib
import ctypes
import io
import json
import os
import queue
import resource
import secrets
import selectors
import signal
import stat as stat_module
import struct
import subprocess
import sys
import tarfile
import threading
import time

HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 192 << 20  # the host's cap too (sandboxes/channel.py)
MAX_FILE_BYTES = 128 << 20  # the most read_file / get_archive may return (base64 fits a frame)
MAX_OUTPUT_BYTES = 32 << 20  # the most output kept per stream of one command
EXIT_GRACE_S = 0.2  # how long output may keep arriving after the command itself exited
MARKER_VARIABLE = "HARNESS_EXEC"
REAP_INTERVAL_S = 0.5
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
_command_user = None  # (uid, gid) commands and file operations run as; None: this process's own
_libc = None


def main(argv):
    global _workdir, _command_user
    config = json.loads(argv[1]) if len(argv) > 1 else {}
    _workdir = config.get("workdir") or os.getcwd()
    BASE_ENV["HOME"] = _workdir
    BASE_ENV.update(config.get("env") or {})
    if config.get("command_user"):
        _command_user = tuple(int(part) for part in config["command_user"])
    _apply_rlimits(config.get("rlimits") or {})
    _make_undumpable()
    # No handler for any signal: as a pid namespace's init that makes the executor immune to signals
    # sent from inside (Python installs one for SIGINT).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if os.getpid() == 1:
        threading.Thread(target=_reap_orphans, daemon=True).start()
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
    marker = secrets.token_hex(8)
    env[MARKER_VARIABLE] = marker
    stdin_data = _b64decode(request.get("stdin"))
    timeout_s = request.get("timeout_s")
    cap = min(int(request.get("max_output_bytes") or (1 << 20)), MAX_OUTPUT_BYTES)
    cwd = _resolve(request["cwd"]) if request.get("cwd") else _workdir
    with _as_command_user():
        if not os.path.isdir(cwd):
            raise NotADirectoryError(f"working directory {request['cwd']} does not exist")
    started = time.monotonic()
    user = {}
    if _command_user is not None:
        user = {"user": _command_user[0], "group": _command_user[1], "extra_groups": []}
    # Started and registered under the lock the orphan reaper takes, so it never reaps a command of ours
    # (Popen would then report exit status 0 for a command that failed).
    with _children_lock:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,  # its own process group, so a timeout can kill the whole tree
                **user,
            )
        except FileNotFoundError as exc:
            message = f"{argv[0]}: command not found ({exc.strerror})"
            return _exec_result(127, b"", message.encode(), started)
        except PermissionError as exc:
            message = f"{argv[0]}: permission denied ({exc.strerror})"
            return _exec_result(126, b"", message.encode(), started)
        except OSError as exc:  # EAGAIN when the sandbox's process limit is reached, ENOMEM, ...
            return _exec_result(126, b"", (f"{argv[0]}: could not start: {exc}").encode(), started)
        _children.add(proc.pid)
    try:
        if request.get("cpu_s"):
            cpu = int(request["cpu_s"])
            resource.prlimit(proc.pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        deadline = started + timeout_s if timeout_s else None
        outputs, timed_out = _collect(proc, deadline, cap, stdin_data)
        if not timed_out:
            try:
                proc.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:  # closed its output but kept running
                timed_out = True
        if timed_out:
            _kill_tree(proc.pid, marker)
        else:
            _kill_group(proc.pid, wait=True)  # what it left in the background; `setsid` keeps a service
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


def _collect(proc, deadline, cap, stdin_data=None):
    """Feed stdin and read stdout and stderr until both close (or the command exits and EXIT_GRACE_S
    passes), keeping the first `cap` bytes of each and discarding the rest, so huge output costs time but
    not memory. All on this thread: a sandbox whose process limit is reached still gets its answer."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    dropped = dict.fromkeys(buffers, 0)
    order = list(buffers)
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin_data) if stdin_data else None
    if stdin_data is not None and not stdin_data:
        proc.stdin.close()
    elif pending is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
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
                if pending is not None and key.fd == proc.stdin.fileno():
                    try:
                        pending = pending[os.write(key.fd, pending[:READ_CHUNK]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # the command closed its stdin: the rest is dropped
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(key.fd)
                        with contextlib.suppress(OSError):
                            proc.stdin.close()
                        pending = None
                    continue
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
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
    return [(buffers[fd], dropped[fd]) for fd in order], timed_out


def _kill_tree(pid, marker=None):
    """Kill a command's process group, every descendant that left it, and every process carrying its
    marker (one that detached from its parent too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGSTOP)
    _freeze_then_kill(lambda: _descendants(pid) | (_marked(marker) if marker else set()) | {pid})
    _kill_group(pid)


def _freeze_then_kill(find):
    """SIGSTOP what `find()` returns until a sweep finds nothing new (a stopped process cannot fork, so a
    fork bomb runs out of new children), then SIGKILL it all. A sweep waits (briefly) until its victims
    are seen stopped: a signal lands asynchronously, and a fork already under way still makes a child."""
    stopped = set()
    for _ in range(50):
        victims = find() - stopped
        if not victims:
            break
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGSTOP)
        _await_state(victims, b"TtZX", 0.2)
        stopped |= victims
    victims = stopped | find()
    for victim in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)
    _await_gone(victims)
    return len(stopped)


def _await_state(pids, states, wait_s):
    """Wait up to `wait_s` until each of `pids` is in one of `states` (letters of /proc/PID/stat) or gone."""
    _poll_stats(pids, wait_s, 0.001, lambda pid, stat: _state(stat) in states)


def _await_gone(pids, wait_s=2.0):
    """Wait (briefly) until killed processes are gone; as pid 1, reap those re-parented to us, so the
    sandbox holds no zombies of them once the answer is sent."""
    me = os.getpid()

    def settled(pid, stat):
        if _state(stat) != b"Z":
            return False  # not dead yet
        if pid in _children:
            return True  # our command: its Popen reaps it
        if _parent(stat) == me and me == 1:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        return False  # gone at the next look

    _poll_stats(pids, wait_s, 0.005, settled)


def _poll_stats(pids, wait_s, interval_s, settled):
    """Read /proc/PID/stat of each of `pids` until `settled(pid, stat)` or the process is gone, for at most
    `wait_s`."""
    deadline = time.monotonic() + wait_s
    remaining = set(pids)
    while remaining and time.monotonic() < deadline:
        for pid in list(remaining):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                remaining.discard(pid)  # gone
                continue
            if settled(pid, stat):
                remaining.discard(pid)
        if remaining:
            time.sleep(interval_s)


def _state(stat):
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]


def _kill_group(pid, wait=False):
    """SIGKILL process group `pid`; with `wait`, return only once its members are gone (reaped), so the
    next command does not find what this one left (a fork bomb's children) still holding the pids limit."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if wait:  # read after the kill: a child forked while it landed is in the group (and killed) too
        _await_gone(_group_members(pid))


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
    # the fields after the parenthesised command name: state, ppid, then the process group
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def _group_members(pgid):
    return {pid for pid, stat in _proc_files("stat") if int(stat[stat.rfind(b")") + 2 :].split()[2]) == pgid}


def _marked(marker):
    needle = (f"{MARKER_VARIABLE}={marker}\0").encode()
    with _as_command_user():  # the commands' environments are readable by their own uid
        environs = list(_proc_files("environ"))
    return {pid for pid, environ in environs if environ.startswith(needle) or b"\0" + needle in environ}


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

    def others():
        return {pid for pid, _ in _proc_files("stat")} - keep

    return {"killed": _freeze_then_kill(others)}


def _kill_all_children():
    with _children_lock:
        groups = list(_children)
    for group in groups:
        _kill_tree(group)


# --- files --------------------------------------------------------------------------------------------


def op_read_file(request):
    path = _resolve(request["path"])
    max_bytes = min(int(request.get("max_bytes") or (64 << 20)), MAX_FILE_BYTES)
    with _as_command_user(), _open_regular(path, request["path"], os.O_RDONLY) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise OverflowError(f"{request['path']} is {size} bytes; the limit is {max_bytes}")
        return {"data": base64.b64encode(f.read(max_bytes)).decode()}


def op_write_file(request):
    path = _resolve(request["path"])
    with _as_command_user():
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with _open_regular(path, request["path"], flags) as f:
            f.write(_b64decode(request.get("data")) or b"")
            if request.get("mode") is not None:
                os.fchmod(f.fileno(), int(request["mode"]))
    return {}


def _open_regular(path, shown, flags):
    """The file at `path`, opened without blocking and refused unless it is a regular file: a FIFO, a
    device or a socket the sandbox's code made must not hold an executor thread (or read /dev/zero)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == 6:  # ENXIO: a FIFO no process reads
            raise OSError(f"{shown} is not a regular file (a FIFO, socket or device)") from None
        raise
    try:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{shown} is not a regular file (a FIFO, socket or device)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb" if flags == os.O_RDONLY else "wb")
    except BaseException:
        os.close(fd)
        raise


def op_put_archive(request):
    target = _resolve(request["path"])
    with _as_command_user():
        os.makedirs(target, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(_b64decode(request["data"])), mode="r:*") as archive:
            members = [m for m in archive.getmembers() if _safe_member(m, target)]
            archive.extractall(target, members=members)
    return {}


def op_get_archive(request):
    source = _resolve(request["path"])
    max_bytes = min(int(request.get("max_bytes") or (64 << 20)), MAX_FILE_BYTES)
    with _as_command_user():
        if not os.path.exists(source):
            raise FileNotFoundError(f"{request['path']} does not exist")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            archive.add(source, arcname=".", filter=_regular_entries)
    data = buffer.getvalue()
    if len(data) > max_bytes:
        raise OverflowError(f"archive of {request['path']} is {len(data)} bytes; the limit is {max_bytes}")
    return {"data": base64.b64encode(data).decode()}


def _regular_entries(member):
    """Regular files and directories only: a FIFO or device in the tree is left out, never opened."""
    return member if member.isfile() or member.isdir() else None


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


@contextlib.contextmanager
def _as_command_user():
    """File access with the command user's rights, on this thread only (Linux's fsuid and fsgid are
    per thread), so a path the sandbox's code chose cannot reach what the executor's own uid may."""
    if _command_user is None:
        yield
        return
    libc = _get_libc()
    uid, gid = _command_user
    libc.setfsgid(gid)
    libc.setfsuid(uid)
    try:
        yield
    finally:
        libc.setfsuid(os.getuid())
        libc.setfsgid(os.getgid())


def _get_libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _reap_orphans():
    """As pid 1, reap the zombies of processes commands left behind (they are re-parented to us), never a
    command of ours: Popen reaps those itself."""
    while True:
        time.sleep(REAP_INTERVAL_S)
        with _children_lock:
            for pid, stat in _proc_files("stat"):
                state = _state(stat)
                if state == b"Z" and _parent(stat) == 1 and pid not in _children:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)


# --- process setup ------------------------------------------------------------------------------------


def _apply_rlimits(limits):
    names = {"as": "RLIMIT_AS", "nproc": "RLIMIT_NPROC", "fsize": "RLIMIT_FSIZE", "nofile": "RLIMIT_NOFILE"}
    for key, value in limits.items():
        limit = getattr(resource, names[key])
        resource.setrlimit(limit, (int(value), int(value)))


def _make_undumpable():
    """PR_SET_DUMPABLE 0: same-user processes can no longer ptrace this one or open its /proc files."""
    libc = _get_libc()
    if libc.prctl(4, 0, 0, 0, 0) != 0 or libc.prctl(3, 0, 0, 0, 0) != 0:
        raise SystemExit("the executor could not make itself non-dumpable (prctl PR_SET_DUMPABLE)")


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

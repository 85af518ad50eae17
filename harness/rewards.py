"""Ready-made reward functions: `accuracy_reward` (math answers, checked with math-verify) and format rewards.

    from harness.rewards import accuracy_reward, format_reward
    trainer = AsyncGRPOTrainer(..., reward_funcs=[accuracy_reward, format_reward])

They follow the trainer's calling convention: keyword arguments `prompts`, `completions` (conversational:
each completion is a list of message dicts), `completion_ids` and every dataset column, and they return one
float, or None for "not scored", per completion. The text they look at is the content of the completion's
last assistant message (a plain string completion is taken as that content).

Reasoning ("thinking") is recognised in three shapes: an inline `<think>...</think>` block at the start of
the content; the same block without its opening `<think>` (chat templates such as Qwen3's put `<think>` in
the generation prompt, so the completion starts inside the block); or a separate `reasoning_content` field,
when a response parser has already split the reasoning out of `content`.

math-verify and sympy are imported only in the checker processes, so importing this module is cheap.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CHECK_TIMEOUT_S",
    "NUM_CHECKERS",
    "accuracy_reward",
    "close",
    "format_reward",
    "think_format_reward",
]

CHECK_TIMEOUT_S = 5.0
"""Deadline of one answer check (parsing both sides and comparing them), counted from when a checker process
starts on it. Read at every call, in the process that scores (the rollout worker)."""

NUM_CHECKERS = min(4, os.cpu_count() or 1)
"""Checker processes at most, started on demand; read when the pool is created."""

_STARTUP_TIMEOUT_S = 120.0  # starting a checker: interpreter + `import math_verify` (about 0.5 s when idle)
_INSTALL_HINT = 'accuracy_reward needs math-verify: pip install "agent-harness[math]"'


# ---------------------------------------------------------------------------------------------------------
# Reading completions
# ---------------------------------------------------------------------------------------------------------


def _last_assistant_message(completion: Any) -> dict[str, Any] | None:
    if isinstance(completion, str):
        return {"role": "assistant", "content": completion}
    for message in reversed(completion or []):
        if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
            return message
    return None


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _split_reasoning(completion: Any) -> tuple[str | None, str] | None:
    """(reasoning, rest) of the last assistant message; reasoning is None when there is no reasoning block.

    None when there is no assistant message, or when a `<think>` block is opened but never closed (the
    completion was cut while thinking, so it has no answer).
    """
    message = _last_assistant_message(completion)
    if message is None:
        return None
    content = _text(message.get("content"))
    if "</think>" in content:
        reasoning, _, rest = content.rpartition("</think>")
        reasoning = reasoning.strip()
        reasoning = reasoning.removeprefix("<think>")
        return reasoning, rest
    if "<think>" in content:
        return None
    split_out = message.get("reasoning_content")
    if isinstance(split_out, str) and split_out.strip():
        return split_out, content
    return None, content


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _answer_region(completion: Any) -> tuple[str | None, bool]:
    """What `accuracy_reward` reads the answer from: (text, is_answer_block).

    The text after the reasoning block; when it holds `<answer>...</answer>`, the inside of the last one,
    which is then read like the gold solution (is_answer_block=True). text is None when there is no answer.
    """
    split = _split_reasoning(completion)
    if split is None:
        return None, False
    _, rest = split
    blocks = _ANSWER_TAG.findall(rest)
    if blocks:
        return blocks[-1], True
    return rest, False


# ---------------------------------------------------------------------------------------------------------
# Format rewards
# ---------------------------------------------------------------------------------------------------------

_THINK_TAG = re.compile(r"</?think>")
_NO_ANSWER_TAG = r"(?:(?!</?answer>).)"
_ANSWER_FORMAT = re.compile(rf"\s*<answer>{_NO_ANSWER_TAG}*\S{_NO_ANSWER_TAG}*</answer>\s*", re.DOTALL)


def _reasoning_ok(reasoning: str | None) -> bool:
    return reasoning is not None and bool(reasoning.strip()) and _THINK_TAG.search(reasoning) is None


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the last assistant message is a reasoning block followed by an `<answer>` block, else 0.0.

    The content must match, with re.DOTALL, after the reasoning block (see the module docstring for its
    three accepted shapes):

        ^\\s*<answer>(non-blank text without <answer> or </answer>)</answer>\\s*$

    and the reasoning block must be non-blank and hold no other `<think>` or `</think>`. So the spec's
    `<think>...</think><answer>...</answer>` scores 1.0, with or without whitespace or newlines around and
    between the two blocks; text outside them, a second block of either kind, or an empty block scores 0.0.
    """
    rewards: list[float | None] = []
    for completion in completions:
        split = _split_reasoning(completion)
        ok = split is not None and _reasoning_ok(split[0]) and _ANSWER_FORMAT.fullmatch(split[1]) is not None
        rewards.append(1.0 if ok else 0.0)
    return rewards


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the last assistant message is a closed reasoning block followed by a non-blank answer.

    For thinking models that answer in free text (e.g. "... so the answer is \\boxed{2}.") rather than in
    `<answer>` tags: the reasoning block (see the module docstring for its accepted shapes) must be
    non-blank and closed, and the text after it non-blank, with no further `<think>` or `</think>`.
    A completion cut off while thinking, or with no reasoning at all, scores 0.0.
    """
    rewards: list[float | None] = []
    for completion in completions:
        split = _split_reasoning(completion)
        ok = (
            split is not None
            and _reasoning_ok(split[0])
            and bool(split[1].strip())
            and _THINK_TAG.search(split[1]) is None
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


# ---------------------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------------------


def accuracy_reward(completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the `solution` column mathematically, else 0.0.

    Checked with math-verify (`pip install "agent-harness[math]"`), which parses both sides to SymPy and
    compares them (numerically and symbolically: `\\frac{1}{2}` equals `0.5`).

    What counts as the completion's answer, in the text after the reasoning block:

    - the content of the last `<answer>...</answer>` block, if any, read like the solution (below);
    - otherwise a `\\boxed{...}` answer (the preferred form), or an anchored one: LaTeX or a plain
      expression after "final answer is", "the answer is", "Answer:" ("The answer is 2." counts).
      A bare number or `$...$` expression elsewhere in the text does not count ("So x = 2" scores 0.0).

    A completion cut off inside an unclosed `<think>` block has no answer and scores 0.0.

    The solution is read as one LaTeX expression ("2", "\\frac{\\pi}{4}", "x^2+1", "0.5"), or, when it holds
    `\\boxed`, `$`, `\\(` or `\\[`, as text with the answer in it (a worked solution ending in `\\boxed{}`).
    A solution that does not parse (empty, malformed LaTeX) or is None gives None: not scored.

    Each check runs in a separate checker process (math-verify's own timeouts rely on SIGALRM, which only
    works on a process's main thread, and reward functions run on worker threads), at most `NUM_CHECKERS`
    at a time, with a deadline of `CHECK_TIMEOUT_S` seconds. A check that passes its deadline, or whose
    process dies, scores 0.0; its process is killed and a fresh one takes its place on the next check.
    Call `close()` to stop the checker processes (they are also stopped at interpreter exit).
    """
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(_INSTALL_HINT)
    if len(solution) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(solution)} solutions")

    rewards: list[float | None] = [None] * len(completions)
    tasks: dict[tuple[str, str | None, bool], list[int]] = {}  # identical checks run once
    for index, (completion, gold) in enumerate(zip(completions, solution, strict=True)):
        if gold is None:
            continue
        text, is_block = _answer_region(completion)
        tasks.setdefault((str(gold), text, is_block), []).append(index)
    if not tasks:
        return rewards
    scores = _pool().run_all(list(tasks), float(CHECK_TIMEOUT_S))
    for indices, score in zip(tasks.values(), scores, strict=True):
        for index in indices:
            rewards[index] = score
    return rewards


# ---------------------------------------------------------------------------------------------------------
# Checker processes
#
# The checkers are plain `python -c` subprocesses rather than a multiprocessing pool: a spawned or forkserver
# multiprocessing child re-imports the parent's `__main__` (the training script, with torch and the rest),
# which would cost seconds and hundreds of MB per checker. They talk JSON lines over pipes: the parent sends
# {"gold", "answer", "block"}, the checker answers {"score"}. A checker sends {"ready": true} once
# math_verify is imported, so start-up never counts against a check's deadline.
# ---------------------------------------------------------------------------------------------------------


class _CheckerGone(Exception):
    """The checker process exited or its pipe broke."""


class _Checker:
    """One checker process, used by one thread at a time."""

    def __init__(self) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from harness.rewards import _checker_main; _checker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(message).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise _CheckerGone from exc

    def receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message, or None when none came within timeout_s."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                readable, _, _ = select.select([fd], [], [], remaining)
                chunk = os.read(fd, 65536) if readable else None
            except (OSError, ValueError) as exc:
                raise _CheckerGone from exc
            if chunk == b"":
                raise _CheckerGone
            if chunk:
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError as exc:  # not our protocol: treat the checker as broken
            raise _CheckerGone from exc

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class _CheckerPool:
    """Up to `size` checker processes, started on demand; a checker that misses a deadline is killed."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.owner_pid = os.getpid()
        self._slots = threading.BoundedSemaphore(self.size)
        self._lock = threading.Lock()
        self._idle: list[_Checker] = []
        self._live: set[_Checker] = set()
        self._closed = False

    def _start(self) -> _Checker:
        checker = _Checker()
        with self._lock:
            self._live.add(checker)
        try:
            ready = checker.receive(_STARTUP_TIMEOUT_S)
        except _CheckerGone:
            ready = {"error": "the checker process exited while starting"}
        if ready is None or not ready.get("ready"):
            self._discard(checker)
            error = "it did not start in time" if ready is None else ready.get("error")
            if ready is not None and ready.get("import_error"):
                raise ImportError(f"{_INSTALL_HINT} ({error})")
            raise RuntimeError(f"accuracy_reward could not start a math-verify checker: {error}")
        return checker

    def _take(self) -> _Checker:
        while True:
            with self._lock:
                checker = self._idle.pop() if self._idle else None
            if checker is None:
                return self._start()
            if checker.process.poll() is None:
                return checker
            self._discard(checker)  # died while idle (e.g. killed from outside)

    def _discard(self, checker: _Checker) -> None:
        checker.kill()
        with self._lock:
            self._live.discard(checker)

    def _give_back(self, checker: _Checker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(checker)
                return
        self._discard(checker)

    def check(self, task: tuple[str, str | None, bool], timeout_s: float) -> float | None:
        gold, answer, block = task
        with self._slots:
            checker = self._take()
            healthy = False
            try:
                checker.send({"gold": gold, "answer": answer, "block": block})
                reply = checker.receive(timeout_s)
                if reply is None:
                    return 0.0  # past its deadline
                healthy = True
                return reply["score"]
            except _CheckerGone:
                return 0.0  # the checker died on this input (e.g. killed for memory)
            finally:
                if healthy:
                    self._give_back(checker)
                else:
                    self._discard(checker)

    def run_all(self, tasks: list[tuple[str, str | None, bool]], timeout_s: float) -> list[float | None]:
        """Every task's score, up to `size` at a time; the calling thread works one lane itself."""
        scores: list[float | None] = [None] * len(tasks)
        errors: list[BaseException] = []
        next_index = iter(range(len(tasks)))
        claim = threading.Lock()

        def lane() -> None:
            while True:
                with claim:
                    index = next(next_index, None)
                if index is None or errors:
                    return
                try:
                    scores[index] = self.check(tasks[index], timeout_s)
                except BaseException as exc:
                    errors.append(exc)
                    return

        helpers = [
            threading.Thread(target=lane, name=f"accuracy-reward-{n}", daemon=True)
            for n in range(min(self.size, len(tasks)) - 1)
        ]
        for helper in helpers:
            helper.start()
        lane()
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]
        return scores

    def close(self) -> None:
        with self._lock:
            self._closed = True
            checkers = list(self._live)
            self._idle.clear()
        for checker in checkers:
            self._discard(checker)

    def pids(self) -> list[int]:
        with self._lock:
            return [checker.process.pid for checker in self._live]


_POOL: _CheckerPool | None = None
_POOL_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def _pool() -> _CheckerPool:
    global _POOL, _ATEXIT_REGISTERED
    with _POOL_LOCK:
        if _POOL is None or _POOL.owner_pid != os.getpid():  # none yet, or inherited through fork()
            _POOL = _CheckerPool(NUM_CHECKERS)
            if not _ATEXIT_REGISTERED:
                atexit.register(close)
                _ATEXIT_REGISTERED = True
        return _POOL


def close() -> None:
    """Stop the checker processes of `accuracy_reward`; a later call starts new ones. Safe to call twice."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and pool.owner_pid == os.getpid():  # a forked child leaves its parent's checkers be
        pool.close()


# ---------------------------------------------------------------------------------------------------------
# Inside a checker process
# ---------------------------------------------------------------------------------------------------------


def _checker_main() -> None:
    """A checker's loop: read a task from stdin, write its score to the protocol pipe (the old stdout)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints goes to stderr, not into the protocol

    def send(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")

    parent = os.getppid()

    def watch_parent() -> None:  # an orphan stuck in a check must not spin forever
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()

    try:
        score = _make_scorer()
    except ImportError as exc:
        send({"error": f"{type(exc).__name__}: {exc}", "import_error": True})
        return
    send({"ready": True})
    for line in sys.stdin:
        task = json.loads(line)
        try:
            result = score(task["gold"], task["answer"], task["block"])
        except Exception:
            result = 0.0  # math-verify swallows its own errors; anything else is a failed check
        send({"score": result})


def _make_scorer() -> Any:
    """The checker's scoring function; imports math_verify, with its SIGALRM timeouts turned off."""
    import functools
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # The parent's deadline bounds each check, so math-verify's own timeouts are off (None): they would arm
    # SIGALRM per parse and per comparison, and it warns once that they are off.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    text_config = [
        LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
        ExprExtractionConfig(try_extract_without_anchor=False),
    ]
    solution_text_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    expression_config = [LatexExtractionConfig()]
    has_math_markup = re.compile(r"\\boxed|\$|\\\(|\\\[")

    @functools.lru_cache(maxsize=1024)
    def read_solution(text: str) -> tuple[Any, ...]:
        """A solution, or an <answer> block: one LaTeX expression, or text with delimited LaTeX in it."""
        text = text.strip()
        if not text:
            return ()
        if has_math_markup.search(text):
            return tuple(parse(text, extraction_config=solution_text_config, parsing_timeout=None))
        return tuple(parse(f"${text}$", extraction_config=expression_config, parsing_timeout=None))

    def score(gold: str, answer: str | None, block: bool) -> float | None:
        gold_parsed = read_solution(gold)
        if all(isinstance(item, str) for item in gold_parsed):
            return None  # nothing parsed, or only the raw string: the solution is not usable
        if answer is None:
            return 0.0
        if block:
            answer_parsed = list(read_solution(answer))
        else:
            answer_parsed = parse(answer, extraction_config=text_config, parsing_timeout=None)
        if not answer_parsed:
            return 0.0
        return 1.0 if verify(list(gold_parsed), answer_parsed, timeout_seconds=None) else 0.0

    return score

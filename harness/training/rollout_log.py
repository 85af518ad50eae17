"""The rollouts a run trained on, on disk and on screen.

`RolloutLog` appends the records the worker sends (`harness.rollout.records`) to
`output_dir/rollouts/rollouts-00000.jsonl`, one JSON object per line, each with the trainer's step when it
took the group. A file is closed once it passes `file_bytes`, the next one numbered on; past `max_files`
the oldest is deleted, so a long run keeps its latest rollouts within a fixed size. A resumed run continues
after the highest number it finds. Writes are line-buffered: a crash loses at most the line in progress,
and a reader (`harness report`) skips a torn last line.

`completions_table` renders records as the plain-text table `log_completions` prints at logging steps.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["ROLLOUTS_DIR", "RolloutLog", "completions_table", "read_rollouts"]

ROLLOUTS_DIR = "rollouts"
_NAME = re.compile(r"rollouts-(\d{5})\.jsonl")


class RolloutLog:
    """Rotating JSON-lines files of rollout records under `directory` (see the module docstring)."""

    def __init__(self, directory: str | Path, *, file_bytes: int, max_files: int) -> None:
        if file_bytes < 1 or max_files < 1:
            raise ValueError(f"file_bytes and max_files must be positive, got {file_bytes} and {max_files}")
        self.directory = Path(directory)
        self.file_bytes = file_bytes
        self.max_files = max_files
        self._file: IO[str] | None = None
        self._size = 0
        numbers = [int(m.group(1)) for p in self._existing() if (m := _NAME.fullmatch(p.name))]
        self._number = max(numbers, default=-1)

    def _existing(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _NAME.fullmatch(p.name))

    def write(self, records: Sequence[dict[str, Any]], **extra: Any) -> None:
        """Append each record (with `extra` fields, e.g. step=12) as one line."""
        for record in records:
            line = json.dumps({**record, **extra}, ensure_ascii=False, allow_nan=False) + "\n"
            if self._file is None or self._size >= self.file_bytes:
                self._rotate()
            assert self._file is not None
            self._file.write(line)
            self._size += len(line.encode())

    def _rotate(self) -> None:
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._number += 1
        files = self._existing()
        for old in files[: max(len(files) - self.max_files + 1, 0)]:  # room for the new one
            old.unlink(missing_ok=True)
        path = self.directory / f"rollouts-{self._number:05d}.jsonl"
        self._file = path.open("a", encoding="utf-8", buffering=1)
        self._size = path.stat().st_size

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RolloutLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_rollouts(directory: str | Path) -> list[dict[str, Any]]:
    """Every record under `directory`, oldest file first; a torn or malformed line is skipped."""
    records = []
    for path in RolloutLog(directory, file_bytes=1, max_files=1)._existing():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    text = str(content or "")
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        text += f" [call {function.get('name')}({json.dumps(function.get('arguments'))})]"
    return text


def completions_table(records: Sequence[dict[str, Any]], *, width: int = 100) -> str:
    """A plain-text table of rollouts: step, prompt (its last user message), each turn of the completion
    (assistant text and tool calls, tool results), each function's reward, the total and the advantage."""
    lines = []
    rule = "-" * width
    for record in records:
        rewards = ", ".join(
            f"{name} {value:.3g}" if value is not None else f"{name} -"
            for name, value in (record.get("rewards") or {}).items()
        )
        total, advantage = record.get("reward"), record.get("advantage")
        head = (
            f"step {record.get('step', '?')}  group {record.get('group_id')}  "
            f"reward {'-' if total is None else f'{total:.3g}'} ({rewards})  "
            f"advantage {'-' if advantage is None else f'{advantage:+.3g}'}"
        )
        if record.get("environment"):
            head += f"  env {record['environment']}"
        if record.get("status") == "failed":
            head += f"  FAILED {record.get('error_type')}"
        elif record.get("group_dropped"):
            head += "  (group dropped: equal rewards)"
        lines += [rule, head]
        users = [m for m in record.get("prompt") or [] if m.get("role") == "user"]
        if users:
            lines += textwrap.wrap(f"prompt: {_text(users[-1])}", width, subsequent_indent="  ")[:3]
        for message in record.get("completion") or []:
            text = _text(message).strip().replace("\n", " ") or "(empty)"
            lines += textwrap.wrap(f"{message.get('role')}: {text}", width, subsequent_indent="  ")[:6]
    if lines:
        lines.append(rule)
    return "\n".join(lines)

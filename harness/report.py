"""`harness report RUN_DIR`: one self-contained HTML file to look at a run.

It reads the run folder: the logged metrics (`metrics.jsonl`, written by `harness train` and the demo;
else `trainer_state.json`'s log history in the run folder or its latest checkpoint) and the rollouts the
trainer saved (`rollouts/*.jsonl`, `save_rollouts=True`), and writes `report.html` beside them:

* curves, drawn here as inline SVG: the reward and each reward function, correct-answer and tool-success
  rates where the run logs them, loss, entropy, the sampler/trainer log-prob gap, clip and mask ratios,
  throughput, rollout wait and backpressure;
* a rollout browser: filter by environment, reward and outcome (trained, group dropped, failure type),
  open a rollout to read each turn's messages, tool calls and tool results, the reward of each function,
  the advantage, how it stopped and whether its turns forked. `report.html#rollout=N` opens rollout N.

No network is needed to open it: no scripts, styles or fonts are fetched. The rollouts are text the
policy wrote, so the page never interprets them as markup: they travel as JSON in an inert script element
(with "<" escaped) and are put on the page as text nodes only.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["MAX_ROLLOUTS", "build_report", "read_metrics"]

MAX_ROLLOUTS = 2000  # the latest ones, so that a long run's page stays quick to open

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's logged entries, one per logging step, in order (see the module docstring for sources)."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a run still writing
            if isinstance(row, dict):
                rows.append(row)
        return rows
    candidates = [run_dir / "trainer_state.json"]
    checkpoints = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1] or 0))
    candidates += [p / "trainer_state.json" for p in reversed(checkpoints)]
    for candidate in candidates:
        if candidate.exists():
            history = json.loads(candidate.read_text()).get("log_history", [])
            return [row for row in history if isinstance(row, dict)]
    return []


def _charts(rows: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(title, metric names) of every chart the run has data for."""
    names = sorted({key for row in rows for key, value in row.items() if _number(value) is not None})
    rewards = [n for n in names if n.startswith("rewards/") and n.endswith("/mean")]
    rates = [n for n in names if re.search(r"(correct|success|accuracy)", n) and n not in rewards]
    wanted = [
        ("Reward", ["reward", "reward_kept", *rewards]),
        ("Correct answers and tool success", rates),
        ("Loss", ["loss"]),
        ("Entropy", ["entropy"]),
        ("Sampler against trainer", ["sampling/sampling_logp_difference/mean", "sampling/masked_mean"]),
        ("Clipping", ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"]),
        ("Throughput (tokens/s)", ["perf/wall_clock_trained_tokens_per_s", "rollout/generated_tokens_per_s"]),
        ("Waiting (s)", ["perf/rollout_wait_s", "rollout/backpressure_s", "perf/step_s"]),
    ]
    present = set(names)
    return [(title, [n for n in series if n in present]) for title, series in wanted if set(series) & present]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _svg_chart(title: str, series: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """A line chart of `series` against the step, as inline SVG."""
    width, height, left, right, top, bottom = 420, 220, 52, 12, 28, 56
    points = {}
    for name in series:
        pairs = [
            (float(row.get("step", i + 1)), v)
            for i, row in enumerate(rows)
            if (v := _number(row.get(name))) is not None
        ]
        if pairs:
            points[name] = pairs
    xs = [x for pairs in points.values() for x, _ in pairs]
    ys = [y for pairs in points.values() for _, y in pairs]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom)

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
        'class="frame"/>',
        f'<text x="{left - 4}" y="{top + 4}" class="tick" text-anchor="end">{_fmt(y1)}</text>',
        f'<text x="{left - 4}" y="{height - bottom}" class="tick" text-anchor="end">{_fmt(y0)}</text>',
        f'<text x="{left}" y="{height - bottom + 14}" class="tick">{_fmt(x0)}</text>',
        f'<text x="{width - right}" y="{height - bottom + 14}" class="tick" text-anchor="end">'
        f"step {_fmt(x1)}</text>",
    ]
    for index, (name, pairs) in enumerate(points.items()):
        color = COLORS[index % len(COLORS)]
        coordinates = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pairs)
        parts.append(f'<polyline points="{coordinates}" stroke="{color}" data-metric="{html.escape(name)}"/>')
        if len(pairs) == 1:
            x, y = pairs[0]
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>')
        legend_y = height - bottom + 28 + 12 * (index // 2)
        legend_x = left + (index % 2) * 185
        parts.append(
            f'<rect x="{legend_x}" y="{legend_y - 8}" width="10" height="3" fill="{color}"/>'
            f'<text x="{legend_x + 14}" y="{legend_y - 4}" class="legend">{html.escape(name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.4g}"


def _summary(rows: Sequence[dict[str, Any]], rollouts: Sequence[dict[str, Any]]) -> str:
    steps = [row["step"] for row in rows if isinstance(row.get("step"), int | float)]
    rewarded = [row for row in rows if _number(row.get("reward")) is not None]
    first: dict[str, Any] = rewarded[0] if rewarded else {}
    last: dict[str, Any] = rewarded[-1] if rewarded else {}
    items = [f"{len(rows)} logged steps" + (f" (to step {int(max(steps))})" if steps else "")]
    if first and last:
        items.append(f"reward {first['reward']:.3g} at step {first.get('step')} → {last['reward']:.3g}")
    items.append(f"{len(rollouts)} rollouts saved" if rollouts else "no rollouts saved (save_rollouts=True)")
    return " · ".join(html.escape(item) for item in items)


def build_report(
    run_dir: str | Path, out: str | Path | None = None, *, rollouts_dir: str | Path | None = None
) -> Path:
    """Write the report of the run in `run_dir` (to `out`, default run_dir/report.html; rollouts from
    `rollouts_dir`, default run_dir/rollouts); returns its path. Raises FileNotFoundError when there are
    neither metrics nor rollouts."""
    from harness.training.rollout_log import ROLLOUTS_DIR, read_rollouts

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    rollouts = read_rollouts(Path(rollouts_dir) if rollouts_dir else run_dir / ROLLOUTS_DIR)[-MAX_ROLLOUTS:]
    if not rows and not rollouts:
        raise FileNotFoundError(
            f"{run_dir} has no metrics.jsonl, trainer_state.json or rollouts/: is it a run's output_dir?"
        )
    charts = "".join(_svg_chart(title, series, rows) for title, series in _charts(rows))
    data = json.dumps(rollouts, ensure_ascii=False).replace("<", "\\u003c")  # inert: no "</script>"
    template = resources.files("harness").joinpath("report_page.html").read_text(encoding="utf-8")
    page = (
        template.replace("__TITLE__", html.escape(f"Run report: {run_dir.resolve().name}"))
        .replace("__SUMMARY__", _summary(rows, rollouts))
        .replace("__CHARTS__", charts or "<p>No metrics logged.</p>")
        .replace("__ROLLOUTS__", data)
    )
    path = Path(out) if out is not None else run_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path

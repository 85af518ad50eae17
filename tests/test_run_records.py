"""Rollouts a person can look at: records from the loop, the rotating rollouts files, the completions table
printed by log_completions, and the HTML report (its structure here; in a real browser in
test_report_browser.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_rollout_loop import exact_reverse, make_loop, prompt_rows, run_groups

from harness.report import build_report
from harness.rollout.records import jsonable
from harness.training.rollout_log import RolloutLog, completions_table, read_rollouts

pytestmark = pytest.mark.anyio

HOSTILE = "<img src=x onerror=\"document.body.setAttribute('data-pwned', 1)\"></script><script>bad()</script>"


def record(index: int, **overrides) -> dict:
    base = {
        "rollout_id": f"r{index}",
        "group_id": index // 4,
        "position": index // 4,
        "row_index": index // 4,
        "model_version": 1,
        "environment": "calc" if index % 2 else "search",
        "prompt": [{"role": "user", "content": f"What is {index} + 1?"}],
        "completion": [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": index}}}],
            },
            {"role": "tool", "name": "add", "content": str(index + 1)},
            {"role": "assistant", "content": f"The answer is {index + 1}."},
        ],
        "rewards": {"correct": float(index % 2), "tool_success": 0.25},
        "reward": float(index % 2) + 0.25,
        "advantage": 1.0 if index % 2 else -1.0,
        "group_dropped": False,
        "trained": True,
        "status": "ok",
        "error_type": None,
        "error": None,
        "stop_reason": "stop",
        "num_turns": 2,
        "tool_call_count": 1,
        "tool_failure_count": 0,
        "completion_tokens": 20,
        "samples": 1,
        "step": 1 + index // 4,
    }
    return {**base, **overrides}


async def test_the_loop_sends_readable_records_with_rewards_and_advantages(tmp_path):
    def script(prompt: str, call: int) -> str:
        word = prompt.split("user\n")[-1].split("<|im_end|>")[0]
        return word[::-1] if call % 2 else "no idea"

    loop = make_loop(
        script,
        dataset=prompt_rows("abc"),
        reward_funcs=[exact_reverse],
        tmp_path=tmp_path,
        log_completions=True,
    )
    (result,) = await run_groups(loop, 1)
    assert len(result.records) == 4
    by_reward = sorted(result.records, key=lambda r: r["reward"])
    assert by_reward[0]["rewards"] == {"exact_reverse": 0.0} and by_reward[-1]["rewards"] == {
        "exact_reverse": 1.0
    }
    assert by_reward[0]["advantage"] < 0 < by_reward[-1]["advantage"]
    assert all(r["prompt"][-1]["content"] == "abc" and r["trained"] for r in result.records)
    assert {r["completion"][-1]["content"] for r in result.records} == {"cba", "no idea"}
    json.dumps(result.records, allow_nan=False)  # plain JSON


async def test_without_log_completions_or_save_rollouts_no_records_travel(tmp_path):
    loop = make_loop(lambda prompt, call: "x", dataset=prompt_rows("abc"), reward_funcs=[exact_reverse],
                     tmp_path=tmp_path)  # fmt: skip
    (result,) = await run_groups(loop, 1)
    assert result.records == []


async def test_save_rollouts_every_k_th_group(tmp_path):
    loop = make_loop(lambda prompt, call: "x" if call % 2 else "y", dataset=prompt_rows("a", "b", "c", "d"),
                     reward_funcs=[exact_reverse], tmp_path=tmp_path, save_rollouts=True,
                     save_rollouts_every=2)  # fmt: skip
    results = await run_groups(loop, 4)
    assert [bool(r.records) for r in sorted(results, key=lambda r: r.position)] == [True, False, True, False]


def test_nan_and_numpy_become_plain_json():
    import numpy as np

    assert jsonable({"a": float("nan"), "b": np.float32(2.5), "c": (1, np.int64(2)), "d": math.inf}) == {
        "a": None,
        "b": 2.5,
        "c": [1, 2],
        "d": None,
    }


def test_rollouts_files_rotate_keep_the_newest_and_resume_numbering(tmp_path):
    directory = tmp_path / "rollouts"
    with RolloutLog(directory, file_bytes=600, max_files=3) as log:
        for index in range(40):
            log.write([record(index)], step=index)
    files = sorted(p.name for p in directory.iterdir())
    assert len(files) == 3 and files[-1] > files[0]
    kept = read_rollouts(directory)
    assert kept[-1]["rollout_id"] == "r39" and kept[-1]["step"] == 39  # the newest survive
    assert all(p.stat().st_size < 600 + 2000 for p in directory.iterdir())  # a file passes its cap by a line
    with RolloutLog(directory, file_bytes=600, max_files=3) as resumed:
        resumed.write([record(99)])
    assert sorted(p.name for p in directory.iterdir())[-1] > files[-1]
    with (directory / files[-1]).open("a") as torn:
        torn.write('{"rollout_id": "half')  # a crash mid-line
    assert read_rollouts(directory)[-1]["rollout_id"] == "r99"


def test_the_completions_table_shows_prompt_turns_tools_rewards_and_advantage():
    text = completions_table([record(1), record(2, status="failed", error_type="SandboxDied")])
    assert "What is 1 + 1?" in text and "[call add(" in text and "tool: 2" in text
    assert "correct 1" in text and "tool_success 0.25" in text and "advantage +1" in text
    assert "FAILED SandboxDied" in text


def write_run(tmp_path, rollouts: list[dict]) -> None:
    rows = [
        {
            "step": step,
            "reward": 0.1 * step,
            "rewards/correct/mean": 0.05 * step,
            "rewards/tool_success/mean": 0.2,
            "loss": 1.0 / step,
            "entropy": 2.0 - 0.1 * step,
            "sampling/sampling_logp_difference/mean": 1e-3,
            "sampling/masked_mean": 0.0,
            "clip_ratio/region_mean": 0.01 * step,
            "perf/wall_clock_trained_tokens_per_s": 100.0 + step,
            "perf/rollout_wait_s": 0.5,
            "rollout/backpressure_s": 0.1,
        }
        for step in range(1, 11)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with RolloutLog(tmp_path / "rollouts", file_bytes=1 << 20, max_files=2) as log:
        log.write(rollouts)


def report_of_a_run(tmp_path, num_rollouts: int) -> Path:
    """The report of a run folder (write_run) with `num_rollouts` rollouts and, last, one failed rollout
    whose completion is hostile markup."""
    hostile = record(
        num_rollouts,
        completion=[{"role": "assistant", "content": HOSTILE}],
        status="failed",
        error_type="ParseError",
    )
    write_run(tmp_path, [record(i) for i in range(num_rollouts)] + [hostile])
    return build_report(tmp_path)


def test_the_report_draws_each_curve_and_carries_the_rollouts_inert(tmp_path):
    path = report_of_a_run(tmp_path, 8)
    page = path.read_text()
    assert path == tmp_path / "report.html"
    for metric in ("reward", "rewards/correct/mean", "loss", "entropy", "clip_ratio/region_mean",
                   "sampling/sampling_logp_difference/mean", "perf/rollout_wait_s"):  # fmt: skip
        assert f'data-metric="{metric}"' in page, metric
    data = page.split('<script type="application/json" id="rollouts">')[1].split("</script>")[0]
    assert "<" not in data  # nothing the policy wrote can close the element or open a tag
    assert json.loads(data)[8]["completion"][0]["content"] == HOSTILE
    assert "http://" not in page and "https://" not in page  # nothing fetched


def test_a_folder_that_is_not_a_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="output_dir"):
        build_report(tmp_path)

"""The logging window's reduction rules, on literal observations."""

from __future__ import annotations

import math

from harness.metrics import MetricsWindow, reduction


def test_reduction_by_name():
    assert reduction("sample/dropped_stale_count") == "sum"
    assert reduction("tools/search/call_count") == "sum"
    assert reduction("completions/max_length") == "max"
    assert reduction("sampling/importance_sampling_ratio/min") == "min"
    assert reduction("completions/mean_terminated_length") == "mean"  # "terminated" is not "min"
    assert reduction("rollout/generated_tokens_per_s") == "rate"
    assert reduction("reward") == "mean"


def test_window_reduces_and_merges_across_processes():
    trainer, worker = MetricsWindow(), MetricsWindow()
    trainer.add("reward", 1.0)
    worker.add("reward", 0.0)
    worker.add("reward", 0.5)
    worker.add("sample/dropped_stale_count", 2)
    trainer.add("sample/dropped_stale_count", 3)
    worker.add("sample/staleness_max", 4)
    trainer.add("sample/staleness_max", 2)
    worker.add_rate("rollout/generated_tokens_per_s", 300, 2.0)
    trainer.add_rate("rollout/generated_tokens_per_s", 100, 2.0)
    worker.add("tools/failure_frequency", math.nan)
    trainer.merge(worker.state())
    summary = trainer.summary()
    assert summary["reward"] == 0.5
    assert summary["sample/dropped_stale_count"] == 5
    assert summary["sample/staleness_max"] == 4
    assert summary["rollout/generated_tokens_per_s"] == 100.0
    assert math.isnan(summary["tools/failure_frequency"])
    trainer.reset()
    assert not trainer and trainer.summary() == {}

"""AsyncGRPOConfig: the reference's fields and defaults, the changed TrainingArguments defaults, and
cross-field checks that name the field to change."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from harness.config import AsyncGRPOConfig

REFERENCE_DEFAULTS = {
    "dtype": "float32",
    "trust_remote_code": False,
    "num_generations": 8,
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800.0,
    "epsilon": 0.2,
    "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8,
    "token_budget": None,
    "max_concurrent_rollouts": 512,
    "max_staleness": 4,
    "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0,
    "log_completions": False,
    "num_completions_to_print": None,
    "logging_steps": 1,
    "learning_rate": 1e-6,
    "ignore_data_skip": True,
    "remove_unused_columns": False,
}


def test_reference_fields_and_defaults(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecation noise on every run
        config = AsyncGRPOConfig(output_dir=str(tmp_path))
    for name, value in REFERENCE_DEFAULTS.items():
        assert getattr(config, name) == value, name
    assert config.lr_scheduler_type == "constant"
    assert config.gradient_checkpointing is True
    assert config.epsilon_high == config.epsilon
    assert config.bf16 is False  # no CUDA here: the reference's bf16 default applies on GPUs


def test_every_field_is_documented():
    undocumented = [
        f.name
        for f in dataclasses.fields(AsyncGRPOConfig)
        if f.name in REFERENCE_DEFAULTS and not f.metadata.get("help")
    ]
    assert undocumented == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_generations": 1}, "num_generations"),
        ({"top_p": 0.9}, "top_k"),
        ({"min_p": 0.1}, "top_k"),
        ({"temperature": 0.0}, "temperature"),
        ({"vllm_importance_sampling_clip_min": 6.0}, "vllm_importance_sampling_clip_min"),
        ({"remove_unused_columns": True}, "remove_unused_columns"),
        ({"ignore_data_skip": False}, "ignore_data_skip"),
        ({"weight_sync_steps": 0}, "weight_sync_steps"),
        ({"max_failure_frac": 0.0}, "max_failure_frac"),
        ({"generation_server": "vllm"}, "generation_server"),
    ],
)
def test_cross_field_problems_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        AsyncGRPOConfig(output_dir=str(tmp_path), **kwargs)


def test_top_p_with_top_k_is_accepted(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), top_p=0.95, top_k=512, epsilon_high=0.28)
    assert (config.top_p, config.top_k, config.epsilon_high) == (0.95, 512, 0.28)


def test_sandbox_engines_replace_the_manifests_and_bad_urls_are_refused(tmp_path):
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), sandbox_docker_engines="unix:///a.sock,tcp://10.0.0.2:2376"
    )
    assert config.sandbox_overrides() == {"docker_engines": ("unix:///a.sock", "tcp://10.0.0.2:2376")}
    assert AsyncGRPOConfig(output_dir=str(tmp_path)).sandbox_overrides() == {}
    with pytest.raises(ValueError, match=r"sandbox_docker_engines.*'a.sock' is not an engine URL"):
        AsyncGRPOConfig(output_dir=str(tmp_path), sandbox_docker_engines=["a.sock"])

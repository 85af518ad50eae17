"""`harness train CONFIG.toml`: loading and validating run specs, `--set` overrides, the error messages, the
resolved config written next to the run, and one real two-step run of the command on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.train_config import (
    TrainConfigError,
    load_spec,
    resolve,
    resolved_spec,
    write_resolved,
)

SPEC = """
model = "some/model"
reward_funcs = "harness.rewards:accuracy_reward"

[data]
environment = "arithmetic"
kwargs = { num_rows = 5 }

[args]
output_dir = "{out}"
max_steps = 3
learning_rate = 2e-6
"""


def write_spec(tmp_path: Path, text: str = SPEC, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("{out}", str(tmp_path / "out")))
    return path


def error_of(tmp_path: Path, *overrides: str, text: str = SPEC) -> str:
    with pytest.raises(TrainConfigError) as caught:
        resolve(load_spec(write_spec(tmp_path, text), overrides))
    return str(caught.value)


# --- parsing and overrides -----------------------------------------------------------------------------


def test_a_spec_file_loads_into_a_run_spec(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    assert spec.model == "some/model"
    assert spec.reward_funcs == ("harness.rewards:accuracy_reward",)  # one string is a list of one
    assert spec.generation_server == "builtin"
    assert spec.data == {"environment": "arithmetic", "kwargs": {"num_rows": 5}}
    assert spec.args["learning_rate"] == 2e-6 and spec.base_dir == tmp_path


def test_set_values_are_toml_literals_and_create_tables(tmp_path):
    spec = load_spec(
        write_spec(tmp_path),
        [
            "args.learning_rate=1e-5",
            "args.logging_steps=2",
            "args.log_completions=true",
            "args.report_to=none",  # not a TOML literal: taken as a string
            "args.chat_template_kwargs={enable_thinking = false}",
            "data.kwargs.num_rows=7",
            'tools=["tools.calculator:calculator"]',
            "peft.r=4",
        ],
    )
    assert spec.args["learning_rate"] == 1e-5 and spec.args["logging_steps"] == 2
    assert spec.args["log_completions"] is True and spec.args["report_to"] == "none"
    assert spec.args["chat_template_kwargs"] == {"enable_thinking": False}
    assert spec.data["kwargs"] == {"num_rows": 7}
    assert spec.tools == ("tools.calculator:calculator",)
    assert spec.peft == {"r": 4}


def test_a_spec_can_be_a_dict(tmp_path):
    spec = load_spec({"model": "m", "args": {"max_steps": 1}}, ["args.max_steps=4"])
    assert spec.args == {"max_steps": 4}


def test_generation_server_builtin_by_default_or_a_vllm_url(tmp_path):
    builtin = resolve(load_spec(write_spec(tmp_path)))
    assert builtin.args.generation_server == "builtin"
    external = resolve(load_spec(write_spec(tmp_path), ['generation_server="http://gpu-box:8000"']))
    assert external.args.generation_server == "external"
    assert external.args.vllm_server_base_url == "http://gpu-box:8000"


# --- error messages ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("modle=x", "unknown key 'modle'; did you mean 'model'?"),
        ("args.learnin_rate=1", "unknown key 'args.learnin_rate'; did you mean 'args.learning_rate'?"),
        ("data.kwarg={}", "unknown key 'data.kwarg'; did you mean 'data.kwargs'?"),
        ("peft.rr=4", "[peft]: unknown key 'peft.rr'; did you mean 'peft.r'?"),
    ],
)
def test_unknown_keys_are_rejected_with_the_closest_match(tmp_path, override, message):
    assert message in error_of(tmp_path, override)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("args.max_steps=two", "args.max_steps = 'two': expected int"),
        ("args.log_completions=1", "args.log_completions = 1: expected bool"),
        ("args.num_generations=1", "num_generations must be at least 2"),
        ("args.vllm_server_base_url='http://x'", "set the top-level generation_server"),
        ("generation_server=local", "generation_server = 'local': use \"builtin\" or the URL"),
        ("reward_funcs=3", "reward_funcs = 3: expected a list of import strings"),
        ('reward_funcs=["harness.rewards"]', 'expected an import string "module:attribute"'),
        ('reward_funcs=["harness.rewards:acuracy_reward"]', "did you mean harness.rewards:accuracy_reward?"),
        ('reward_funcs=["no_such_module:f"]', "cannot import 'no_such_module'"),
        ("data.path='x.jsonl'", "[data] needs exactly one of environment, path, function"),
        ("data.kwargs.rows=3", "data.kwargs: ArithmeticEnv.dataset rejected them"),
        ("data.limit=0", "data.limit = 0: expected a positive integer"),
        ('loop_cls="harness.config:AsyncGRPOConfig"', "is not an AsyncRolloutLoop subclass"),
        ("--set", "expected KEY=VALUE"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(tmp_path, override, message):
    assert message in error_of(tmp_path, override)


def test_an_unknown_environment_is_named_with_a_suggestion_before_any_model_loads(tmp_path):
    message = error_of(tmp_path, 'environment_factory="arithmetc"')
    assert message.startswith("environment_factory: no environment named 'arithmetc'")
    assert "Did you mean 'arithmetic'?" in message
    routed = error_of(tmp_path, 'environment_factory={a = "arithmetic", b = "word-gues"}')
    assert routed.startswith("environment_factory.b: no environment named 'word-gues'")
    assert "data.environment: no environment named 'nope'" in error_of(tmp_path, "data.environment=nope")


def test_routes_the_dataset_does_not_have_and_environments_without_a_generator(tmp_path):
    # the arithmetic rows have no `environment` column to route between two environments
    unrouted = error_of(tmp_path, 'environment_factory={a = "arithmetic", b = "counter"}')
    assert "needs an 'environment' column" in unrouted
    assert "has no dataset() generator" in error_of(tmp_path, "data.environment=counter")
    no_data = "model = 'm'\nenvironment_factory = 'counter'\n"
    assert "set args.max_steps > 0" in error_of(tmp_path, text=no_data)


def test_a_malformed_file_says_so(tmp_path):
    with pytest.raises(TrainConfigError, match=r"run.toml is not valid TOML"):
        load_spec(write_spec(tmp_path, "model = \n"))
    with pytest.raises(TrainConfigError, match=r"cannot read the run spec"):
        load_spec(tmp_path / "missing.toml")


# --- resolving -----------------------------------------------------------------------------------------


def test_the_three_data_sources_and_limit(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(6)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "my_data.py").write_text(
        "from datasets import Dataset\n\ndef build(n):\n    return Dataset.from_dict({'prompt': [[]] * n})\n"
    )
    generated = resolve(load_spec(write_spec(tmp_path), ["data.limit=3"])).train_dataset
    assert len(generated) == 3 and generated.column_names == ["seed"]
    from_file = resolve(
        load_spec(write_spec(tmp_path), ["data={path = 'data/train.jsonl'}"])  # relative to the spec's folder
    ).train_dataset
    assert len(from_file) == 6 and from_file[0]["prompt"] == [{"role": "user", "content": "q0"}]
    from_function = resolve(
        load_spec(write_spec(tmp_path), ["data={function = 'my_data:build', kwargs = {n = 4}}"])
    ).train_dataset
    assert len(from_function) == 4


def test_import_strings_resolve_to_objects_and_registry_names_stay_names(tmp_path):
    from harness.rewards import accuracy_reward
    from tools.calculator import calculator

    resolved = resolve(
        load_spec(
            write_spec(tmp_path),
            [
                'tools=["tools.calculator:calculator"]',
                'environment_factory="environments.arithmetic:ArithmeticEnv"',
                "peft={r = 4, target_modules = 'all-linear'}",
            ],
        )
    )
    from environments.arithmetic import ArithmeticEnv

    assert resolved.reward_funcs == [accuracy_reward] and resolved.tools == [calculator]
    assert resolved.environment_factory is ArithmeticEnv
    assert resolved.peft_config.r == 4 and resolved.peft_config.task_type == "CAUSAL_LM"
    named = resolve(load_spec(write_spec(tmp_path), ['environment_factory="arithmetic"']))
    assert named.environment_factory == "arithmetic"


def test_config_cls_lets_args_set_a_subclass_field(tmp_path):
    (tmp_path / "my_config.py").write_text(
        "from dataclasses import dataclass\nfrom harness import AsyncGRPOConfig\n\n"
        "@dataclass\nclass MyConfig(AsyncGRPOConfig):\n    cap: float = 0.5\n"
    )
    resolved = resolve(load_spec(write_spec(tmp_path), ['config_cls="my_config:MyConfig"', "args.cap=0.75"]))
    assert type(resolved.args).__name__ == "MyConfig" and resolved.args.cap == 0.75
    assert "unknown key 'args.cap'" in error_of(tmp_path, "args.cap=0.75")


def test_the_resolved_spec_is_written_with_every_field_and_reloads(tmp_path):
    resolved = resolve(load_spec(write_spec(tmp_path), ["args.learning_rate=1e-5"]))
    path = write_resolved(resolved)
    assert path.parent == tmp_path / "out" and path.name in ("run_config.toml", "run_config.json")
    written = json.loads(path.read_text()) if path.suffix == ".json" else load_spec(path).args
    args = written["args"] if path.suffix == ".json" else written
    assert args["learning_rate"] == 1e-5 and args["max_steps"] == 3
    assert args["num_generations"] == 8 and args["max_staleness"] == 4  # defaults are written too
    again = resolve(load_spec(path))  # the written file is itself a valid spec
    assert again.args.to_dict() == resolved.args.to_dict()
    assert resolved_spec(again)["data"] == {"environment": "arithmetic", "kwargs": {"num_rows": 5}}


# --- the command ---------------------------------------------------------------------------------------


def test_the_command_dry_run_and_its_errors(tmp_path, capsys):
    from harness.cli import main

    spec = write_spec(tmp_path)
    assert main(["train", str(spec), "--set", "args.max_steps=9", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["args"]["max_steps"] == 9 and printed["model"] == "some/model"
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    assert main(["train", str(spec), "--set", "args.max_step=9"]) == 2
    assert "did you mean 'args.max_steps'?" in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True])
def test_the_command_takes_a_torchrun_process_group_down_at_the_end(tmp_path, monkeypatch, fails):
    import torch.distributed as dist

    from harness import train_config
    from harness.cli import main

    def run(*args, **kwargs):
        assert dist.is_initialized()  # the trainer's group, as torchrun and accelerate would have formed it
        if fails:
            raise train_config.TrainConfigError("a bad key")
        return {}

    monkeypatch.setattr(train_config, "run", run)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert main(["train", str(write_spec(tmp_path))]) == (2 if fails else 0)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_harness_help_does_not_import_the_trainer_stack():
    code = "import sys; import harness.cli as c; c.build_parser(); print(sorted({'torch', 'transformers', \
'harness.train_config'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- one real run ----------------------------------------------------------------------------------------

REWARDS_MODULE = '''
def length_reward(completion_ids, **kwargs):
    """Varies with the sampled tokens, so a random model's groups have a spread."""
    return [float(sum(ids) % 7) for ids in completion_ids]
'''

E2E_SPEC = """
model = "{model}"
reward_funcs = ["run_rewards:length_reward"]
tools = ["tools.calculator:calculator"]

[data]
path = "prompts.jsonl"

[args]
output_dir = "{out}"
max_steps = 5
num_generations = 4
max_completion_length = 12
max_concurrent_rollouts = 8
max_tool_calling_iterations = 2
gradient_checkpointing = false
learning_rate = 1e-3
token_budget = 1024
save_strategy = "no"
report_to = "none"
disable_tqdm = true
save_rollouts = true
log_completions = true
num_completions_to_print = 2

[peft]
r = 4
target_modules = "all-linear"
"""


@pytest.mark.slow
def test_harness_train_runs_two_steps_on_cpu(tmp_path, tiny_model_dir):
    (tmp_path / "run_rewards.py").write_text(REWARDS_MODULE)  # imported from the spec's folder
    prompts = [{"prompt": [{"role": "user", "content": f"count to {i}"}]} for i in range(16)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    spec = write_spec(tmp_path, E2E_SPEC.replace("{model}", tiny_model_dir))
    harness = Path(sys.executable).with_name("harness")
    done = subprocess.run(
        [str(harness), "train", str(spec), "--set", "args.max_steps=2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path.parent,  # the spec's folder is on the import path wherever the command runs
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = tmp_path / "out"
    config_file = next(out.glob("run_config.*"))
    written = json.loads(config_file.read_text()) if config_file.suffix == ".json" else load_spec(config_file)
    assert (written["args"] if isinstance(written, dict) else written.args)["max_steps"] == 2
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in entries] == [1, 2]
    merged = {key: value for entry in entries for key, value in entry.items()}
    for name in (
        "reward",
        "rewards/length_reward/mean",
        "frac_reward_zero_std",
        "loss",
        "entropy",
        "num_tokens",
        "completions/mean_length",
        "tools/call_frequency",
        "rollout/generated_tokens_per_s",
        "sample/staleness_max",
        "batch/packing_ratio",
        "perf/step_s",
    ):
        assert name in merged and math.isfinite(merged[name]), name
    # log_completions: two rollouts printed at each logging step; save_rollouts: all of them on disk
    assert done.stdout.count("completions at step") == 2 and "reward " in done.stdout
    saved = [
        json.loads(line)
        for path in (out / "rollouts").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert saved and all("length_reward" in record["rewards"] for record in saved)
    report = subprocess.run([str(harness), "report", str(out)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and report.stdout.strip() == str(out / "report.html"), report.stderr

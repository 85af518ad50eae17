"""A training run described in a file: load a TOML run spec, apply `--set` overrides, validate, resolve
it into the trainer's arguments, write the resolved config next to the run, and train.

    harness train run.toml --set args.learning_rate=1e-5 --set args.max_steps=200
    harness.train_config.run("run.toml", ["args.max_steps=200"])      # the same from Python

The spec (every key but `model` is optional; import strings are "module:attribute"):

    model = "Qwen/Qwen3-0.6B"                        # a local folder or a hub id
    generation_server = "builtin"                    # or a vLLM URL, "http://localhost:8000", or several:
                                                     # ["http://gpu0:8000", "http://gpu1:8000"]
    reward_funcs = ["harness.rewards:accuracy_reward"]
    tools = ["mypkg.tools:search"]
    environment_factory = "arithmetic"               # a registry name or an import string, or a table
                                                     # {route name = registry name or import string}
    loop_cls = "mypkg.loops:CurriculumRolloutLoop"   # an AsyncRolloutLoop subclass
    config_cls = "mypkg.loops:CurriculumConfig"      # an AsyncGRPOConfig subclass for [args]
    python_path = ["src"]                            # extra import folders (the file's own is always one)

    [data]                  # the prompts, one source of three (none: the environment makes them)
    environment = "arithmetic"                # that environment's `dataset(**kwargs)` generator
    # path = "train.jsonl"                    # a local .json / .jsonl / .parquet / .csv file
    # function = "mypkg.data:build"           # a function returning a datasets.Dataset
    kwargs = { num_rows = 256 }               # keyword arguments of the generator / function / loader
    limit = 64                                # keep the first rows only

    [args]                  # AsyncGRPOConfig (or config_cls) fields, checked by name and type
    output_dir = "runs/arithmetic"
    max_steps = 100

    [peft]                  # peft.LoraConfig keyword arguments; no table: full fine-tuning
    r = 16

Relative paths in `data.path` and `python_path` are read from the spec file's folder; `model` and
`args.output_dir` from the working directory. Every error is a `TrainConfigError` naming the key and
the fix; an unknown key names the closest known one. Before training, the resolved spec (overrides
applied, every `[args]` field with its final value) is written to output_dir/run_config.toml when
`tomli_w` is installed (TOML has no null: unset fields are left out), else to run_config.json; either
file is a valid spec for `harness train`. Logged metrics go to output_dir/metrics.jsonl, one line per
logging step.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from harness.config import AsyncGRPOConfig
from harness.generation.router import server_urls

__all__ = [
    "MetricsFile",
    "ResolvedRun",
    "RunSpec",
    "TrainConfigError",
    "build_args",
    "build_trainer",
    "load_spec",
    "resolve",
    "resolved_spec",
    "run",
    "write_resolved",
]

TOP_LEVEL_KEYS = (
    "model",
    "generation_server",
    "reward_funcs",
    "tools",
    "environment_factory",
    "loop_cls",
    "config_cls",
    "python_path",
    "data",
    "args",
    "peft",
)
DATA_SOURCES = ("environment", "path", "function")
DATA_KEYS = (*DATA_SOURCES, "kwargs", "limit")
_FILE_LOADERS = {".json": "from_json", ".jsonl": "from_json", ".parquet": "from_parquet", ".csv": "from_csv"}
_SERVER_ARGS = ("generation_server", "vllm_server_base_url")  # set through the top-level key only


class TrainConfigError(ValueError):
    """A run spec that cannot be used; the message names the key and what to change."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A validated run spec: plain data, nothing imported or built yet."""

    model: str
    generation_server: str | tuple[str, ...] = "builtin"  # "builtin", or the servers' URLs
    reward_funcs: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    environment_factory: str | dict[str, str] | None = None
    loop_cls: str | None = None
    config_cls: str | None = None
    python_path: tuple[str, ...] = ()
    data: dict[str, Any] | None = None
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    peft: dict[str, Any] | None = None
    base_dir: Path = Path()


@dataclasses.dataclass
class ResolvedRun:
    """What the trainer is built from: the spec's import strings and tables turned into objects."""

    spec: RunSpec
    args: AsyncGRPOConfig
    train_dataset: Any
    reward_funcs: list[Callable[..., Any]]
    tools: list[Callable[..., Any]]
    environment_factory: Any
    loop_cls: type | None
    peft_config: Any


# --- loading and validating ------------------------------------------------------------------------------


def load_spec(source: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> RunSpec:
    """Read a spec (a .toml or .json file, or a dict), apply `KEY.PATH=VALUE` overrides, and validate it."""
    if isinstance(source, Mapping):
        raw, base_dir = _copy_tables(source), Path.cwd()
    else:
        path = Path(source)
        raw, base_dir = _read_file(path), path.resolve().parent
    for override in overrides:
        _apply_override(raw, override)
    return _validate(raw, base_dir)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TrainConfigError(f"cannot read the run spec {path}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise TrainConfigError(f"{path} is not valid {kind}: {exc}") from exc


def _apply_override(raw: dict[str, Any], override: str) -> None:
    """`args.learning_rate=1e-5`: the value is a TOML literal (1e-5, true, "x", [1, 2], {r = 8}); a value
    that is not one (`args.report_to=none`) is taken as a plain string."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise TrainConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. --set args.learning_rate=1e-5")
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    table = raw
    for depth, part in enumerate(parts[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise TrainConfigError(f"--set {override!r}: {'.'.join(parts[: depth + 1])} is not a table")
    table[parts[-1]] = value


def _validate(raw: dict[str, Any], base_dir: Path) -> RunSpec:
    _reject_unknown(raw, TOP_LEVEL_KEYS, "the run spec")
    if "model" not in raw:
        raise TrainConfigError('the run spec has no `model`: add model = "path/or/hub-id" at the top')
    model = _expect(raw["model"], str, "model", "a path or hub id")
    server = _generation_server(raw.get("generation_server", "builtin"))
    factory = raw.get("environment_factory")
    if isinstance(factory, dict):
        for name, value in factory.items():
            _expect(value, str, f"environment_factory.{name}", "a registry name or an import string")
    elif factory is not None:
        _expect(factory, str, "environment_factory", "a registry name, an import string or a table")
    data = _validate_data(raw.get("data"))
    args = dict(_expect(raw.get("args", {}), dict, "args", "a table of AsyncGRPOConfig fields"))
    for key in _SERVER_ARGS:
        if key in args:
            raise TrainConfigError(
                f'args.{key}: set the top-level generation_server instead ("builtin" or the server\'s URL)'
            )
    peft = raw.get("peft")
    if peft is not None:
        _expect(peft, dict, "peft", "a table of peft.LoraConfig arguments")
    return RunSpec(
        model=model,
        generation_server=server,
        reward_funcs=_strings(raw.get("reward_funcs", []), "reward_funcs"),
        tools=_strings(raw.get("tools", []), "tools"),
        environment_factory=factory,
        loop_cls=_optional_str(raw.get("loop_cls"), "loop_cls"),
        config_cls=_optional_str(raw.get("config_cls"), "config_cls"),
        python_path=_strings(raw.get("python_path", []), "python_path"),
        data=data,
        args=args,
        peft=dict(peft) if peft is not None else None,
        base_dir=base_dir,
    )


def _generation_server(value: Any) -> str | tuple[str, ...]:
    """ "builtin", or the servers' URLs: one (a string), several (a list, or a string separated by commas)."""
    if value == "builtin":
        return "builtin"
    usage = (
        'use "builtin" or the URL of a vLLM server, e.g. "http://localhost:8000", or a list of URLs for '
        'several, e.g. ["http://gpu0:8000", "http://gpu1:8000"]'
    )
    if not isinstance(value, str | list):
        raise TrainConfigError(f"generation_server = {value!r}: {usage}")
    try:
        urls = server_urls(value)
    except ValueError as exc:
        problem = str(exc).removeprefix("vllm_server_base_url").lstrip(": ")
        raise TrainConfigError(f"generation_server = {value!r}: {usage} ({problem})") from exc
    return urls[0] if len(urls) == 1 and isinstance(value, str) else tuple(urls)


def _validate_data(data: Any) -> dict[str, Any] | None:
    if data is None:
        return None
    _expect(data, dict, "data", "a table")
    _reject_unknown(data, DATA_KEYS, "[data]", prefix="data.")
    sources = [key for key in DATA_SOURCES if key in data]
    if len(sources) != 1:
        raise TrainConfigError(
            f"[data] needs exactly one of environment, path, function; got {sources or 'none'}. "
            "Without prompts from a dataset, leave [data] out and let the environment make them."
        )
    _expect(data[sources[0]], str, f"data.{sources[0]}", "a string")
    _expect(data.get("kwargs", {}), dict, "data.kwargs", "a table of keyword arguments")
    limit = data.get("limit")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise TrainConfigError(f"data.limit = {limit!r}: expected a positive integer")
    return dict(data)


def _reject_unknown(table: Mapping[str, Any], known: Sequence[str], where: str, prefix: str = "") -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            listing = f"known keys: {', '.join(known)}" if len(known) <= 12 else "check the spelling"
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; {listing}"
            raise TrainConfigError(f"{where}: unknown key '{prefix}{key}'{hint}")


def _expect(value: Any, kind: type, key: str, what: str) -> Any:
    if not isinstance(value, kind):
        raise TrainConfigError(f"{key} = {value!r}: expected {what}")
    return value


def _optional_str(value: Any, key: str) -> str | None:
    return None if value is None else _expect(value, str, key, 'an import string "module:attribute"')


def _strings(value: Any, key: str) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(item, str) for item in values):
        raise TrainConfigError(f'{key} = {value!r}: expected a list of import strings ["module:attribute"]')
    return tuple(values)


# --- [args]: names and types of the config dataclass -----------------------------------------------------


def build_args(spec: RunSpec, config_cls: type[AsyncGRPOConfig] = AsyncGRPOConfig) -> AsyncGRPOConfig:
    """The trainer config from [args] and generation_server; names and simple types are checked first."""
    hints = typing.get_type_hints(config_cls)
    fields = [field.name for field in dataclasses.fields(config_cls) if field.init]
    _reject_unknown(spec.args, [name for name in fields if name not in _SERVER_ARGS], "[args]", "args.")
    for name, value in spec.args.items():
        if not _matches(value, hints.get(name, Any)):
            raise TrainConfigError(f"args.{name} = {value!r}: expected {_describe(hints[name])}")
    values = dict(spec.args)
    values.setdefault("output_dir", "harness-output")
    if spec.generation_server == "builtin":
        values["generation_server"] = "builtin"
    else:
        server = spec.generation_server
        urls = server if isinstance(server, str) else list(server)
        values.update(generation_server="external", vllm_server_base_url=urls)
    try:
        return config_cls(**values)
    except (ValueError, TypeError) as exc:
        raise TrainConfigError(f"[args]: {exc}") from exc


def _matches(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a field's annotation; types this cannot judge are left to the config."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, option) for option in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, dict) or hint in (list, dict):
        return isinstance(value, origin or hint)
    if isinstance(hint, type) and issubclass(hint, str):  # str enums (IntervalStrategy, ...)
        return isinstance(value, str)
    return True


def _describe(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


# --- resolving: import strings, the dataset, environments, peft ---------------------------------------


def resolve(spec: RunSpec) -> ResolvedRun:
    """Import what the spec names and build the config, dataset and peft config (no model is loaded).

    The spec's folder and its python_path are appended to sys.path, for good (after the installed
    packages, so a local file never shadows one): the rollout worker is spawned with this process's
    sys.path, and must import the same reward functions and classes."""
    for folder in (*spec.python_path, "."):
        path = str((spec.base_dir / folder).resolve())
        if path not in sys.path:
            sys.path.append(path)
    config_cls = AsyncGRPOConfig
    if spec.config_cls:
        config_cls = _import(spec.config_cls, "config_cls")
        if not (isinstance(config_cls, type) and issubclass(config_cls, AsyncGRPOConfig)):
            raise TrainConfigError(f"config_cls = {spec.config_cls!r} is not an AsyncGRPOConfig subclass")
    args = build_args(spec, config_cls)
    loop_cls = None
    if spec.loop_cls:
        from harness.rollout.loop import AsyncRolloutLoop

        loop_cls = _import(spec.loop_cls, "loop_cls")
        if not (isinstance(loop_cls, type) and issubclass(loop_cls, AsyncRolloutLoop)):
            raise TrainConfigError(f"loop_cls = {spec.loop_cls!r} is not an AsyncRolloutLoop subclass")
    factory = _environment_factory(spec.environment_factory)
    dataset = _dataset(spec)
    _check_environments(factory, dataset, args)
    return ResolvedRun(
        spec=spec,
        args=args,
        train_dataset=dataset,
        reward_funcs=[_import(t, f"reward_funcs[{i}]") for i, t in enumerate(spec.reward_funcs)],
        tools=[_import(t, f"tools[{i}]") for i, t in enumerate(spec.tools)],
        environment_factory=factory,
        loop_cls=loop_cls,
        peft_config=_peft_config(spec.peft),
    )


def _import(target: str, key: str) -> Any:
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise TrainConfigError(f'{key} = {target!r}: expected an import string "module:attribute"')
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise TrainConfigError(f"{key} = {target!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attribute.split("."):
        if not hasattr(obj, part):
            names = [name for name in dir(obj) if not name.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            hint = f"; did you mean {module_name}:{close[0]}?" if close else ""
            raise TrainConfigError(f"{key} = {target!r}: {module_name} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _environment_factory(value: str | dict[str, str] | None) -> Any:
    """Registry names stay names (the trainer loads them by name); import strings become objects."""
    if isinstance(value, dict):
        return {name: _one_factory(target, f"environment_factory.{name}") for name, target in value.items()}
    return None if value is None else _one_factory(value, "environment_factory")


def _one_factory(target: str, key: str) -> Any:
    from environments import EnvironmentsError, load

    if ":" in target:
        return _import(target, key)
    try:
        load(target)  # fail here, with the registry's "did you mean", rather than after loading the model
    except EnvironmentsError as exc:
        raise TrainConfigError(f"{key}: {exc}") from exc
    return target


def _check_environments(factory: Any, dataset: Any, args: AsyncGRPOConfig) -> None:
    from environments import EnvironmentsError, check_routes, resolve_environments

    try:
        routed = resolve_environments(factory)
        if dataset is not None:
            columns = list(dataset.column_names)
            routes = dataset["environment"] if "environment" in columns else None
            check_routes(columns, routes, routed)
    except EnvironmentsError as exc:
        raise TrainConfigError(f"environment_factory: {exc}") from exc
    if dataset is None and not routed:
        raise TrainConfigError("no prompts: add a [data] table, or an environment_factory that makes them")
    if dataset is None and args.max_steps <= 0:
        raise TrainConfigError("without [data] the environment makes the prompts: set args.max_steps > 0")


def _dataset(spec: RunSpec) -> Any:
    data = spec.data
    if data is None:
        return None
    kwargs = data.get("kwargs", {})
    if "environment" in data:
        from environments import EnvironmentsError, load
        from environments.base import environment_class

        try:
            cls = environment_class(load(data["environment"]))
        except EnvironmentsError as exc:
            raise TrainConfigError(f"data.environment: {exc}") from exc
        if not callable(getattr(cls, "dataset", None)):
            raise TrainConfigError(
                f"data.environment = {data['environment']!r}: that environment has no dataset() generator; "
                "use data.function or data.path, or leave [data] out and set args.max_steps"
            )
        build, what = getattr(cls, "dataset"), f"{cls.__name__}.dataset"  # noqa: B009 -- a classmethod
    elif "function" in data:
        build, what = _import(data["function"], "data.function"), data["function"]
    else:
        path = spec.base_dir / data["path"]
        loader = _FILE_LOADERS.get(path.suffix)
        if loader is None:
            raise TrainConfigError(f"data.path = {data['path']!r}: use a {', '.join(_FILE_LOADERS)} file")
        if not path.is_file():
            raise TrainConfigError(f"data.path = {data['path']!r}: no such file {path}")
        from datasets import Dataset

        build, what, kwargs = getattr(Dataset, loader), str(path), {"path_or_paths": str(path), **kwargs}
    try:
        dataset = build(**kwargs)
    except TypeError as exc:
        raise TrainConfigError(f"data.kwargs: {what} rejected them: {exc}") from exc
    if "limit" in data:
        dataset = dataset.select(range(min(data["limit"], len(dataset))))
    return dataset


def _peft_config(table: dict[str, Any] | None) -> Any:
    if table is None:
        return None
    from peft import LoraConfig

    known = [field.name for field in dataclasses.fields(LoraConfig) if field.init]
    _reject_unknown(table, known, "[peft]", "peft.")
    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **table})
    except (ValueError, TypeError) as exc:
        raise TrainConfigError(f"[peft]: {exc}") from exc


# --- the resolved file, the metrics file, the run ---------------------------------------------------------


def resolved_spec(resolved: ResolvedRun) -> dict[str, Any]:
    """The spec as it runs: overrides applied, every [args] field with its value, paths made absolute."""
    spec = resolved.spec
    server = spec.generation_server
    out: dict[str, Any] = {
        "model": spec.model,
        "generation_server": server if isinstance(server, str) else list(server),
    }
    for key in ("reward_funcs", "tools", "environment_factory", "loop_cls", "config_cls"):
        value = getattr(spec, key)
        if value:
            out[key] = list(value) if isinstance(value, tuple) else value
    out["python_path"] = [str((spec.base_dir / p).resolve()) for p in (*spec.python_path, ".")]
    if spec.data is not None:
        out["data"] = dict(spec.data)
        if "path" in spec.data:
            out["data"]["path"] = str((spec.base_dir / spec.data["path"]).resolve())
    args = resolved.args.to_dict()
    out["args"] = {
        key: value
        for key, value in args.items()
        if key not in _SERVER_ARGS and not key.endswith("_token")  # to_dict masks secrets anyway
    }
    if spec.peft is not None:
        out["peft"] = dict(spec.peft)
    return out


def write_resolved(resolved: ResolvedRun) -> Path:
    """Write the resolved spec to output_dir/run_config.toml (with tomli_w) or run_config.json."""
    directory = Path(resolved.args.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    spec = resolved_spec(resolved)
    try:
        import tomli_w
    except ImportError:
        path = directory / "run_config.json"
        path.write_text(json.dumps(spec, indent=2) + "\n")
        return path
    path = directory / "run_config.toml"
    path.write_text(tomli_w.dumps(_without_none(spec)))
    return path


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    return value


class MetricsFile(TrainerCallback):
    """Appends each logged metrics dict, with its step, as one JSON line to `path` (main process only)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any):
        if state.is_world_process_zero:
            self.path.unlink(missing_ok=True)  # one run per file

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any):
        if logs and state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as stream:
                stream.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def build_trainer(resolved: ResolvedRun) -> Any:
    """The AsyncGRPOTrainer of a resolved run, logging to output_dir/metrics.jsonl."""
    from harness.training.trainer import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        resolved.spec.model,
        reward_funcs=resolved.reward_funcs,
        args=resolved.args,
        train_dataset=resolved.train_dataset,
        peft_config=resolved.peft_config,
        tools=resolved.tools,
        environment_factory=resolved.environment_factory,
        callbacks=[MetricsFile(Path(resolved.args.output_dir) / "metrics.jsonl")],
    )
    if resolved.loop_cls is not None:
        trainer.loop_cls = resolved.loop_cls  # read when the worker starts
    return trainer


def run(
    source: str | Path | Mapping[str, Any], overrides: Sequence[str] = (), *, dry_run: bool = False
) -> Any:
    """Load, resolve, write the resolved spec, train. Returns the TrainOutput, or with `dry_run` the
    resolved spec (nothing written, no model loaded)."""
    resolved = resolve(load_spec(source, overrides))
    if dry_run:
        return resolved_spec(resolved)
    write_resolved(resolved)
    return build_trainer(resolved).train()


def _copy_tables(source: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _copy_tables(v) if isinstance(v, Mapping) else v for key, v in source.items()}

"""agent-harness: asynchronous GRPO training for LLM agents that call tools inside sandboxes.

The public API is imported lazily (PEP 562), so `import harness` and `harness --help` stay fast:
torch and transformers load only when a name that needs them is first used.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "AsyncGRPOConfig": "harness.config",
    "AsyncGRPOTrainer": "harness.trainer",
    "AsyncRolloutLoop": "harness.rollout",
    "Rollout": "harness.types",
    "RolloutGroup": "harness.types",
    "TurnRecord": "harness.types",
    "TrainingSequence": "harness.types",
    "GenerationClient": "harness.client",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

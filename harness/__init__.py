"""agent-harness: asynchronous GRPO training for LLM agents that call tools inside sandboxes.

The public API is imported lazily (PEP 562), so `import harness` and `harness --help` stay fast:
torch and transformers load only when a name that needs them is first used.
"""

from harness._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "AsyncGRPOConfig": "harness.config",
    "AsyncGRPOTrainer": "harness.training.trainer",
    "AsyncRolloutLoop": "harness.rollout.loop",
    "Rollout": "harness.types",
    "RolloutGroup": "harness.types",
    "TurnRecord": "harness.types",
    "TrainingSequence": "harness.types",
    "GenerationClient": "harness.generation.client",
}

__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

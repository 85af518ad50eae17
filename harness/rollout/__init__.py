"""The rollout side: everything the spawned rollout worker process runs (no GPU, no training code).

    loop.py        AsyncRolloutLoop: dispatch prompts, run each rollout's tool loop, score groups, queue
    samples
    worker.py      the worker process, and the trainer's handle on it (RolloutWorker)
    env_pool.py    per-environment instance pools; sync hooks off the event loop
    pacing.py      the token allowance, the concurrency cap, the failure breaker
    scoring.py     reward functions (sync and async), group advantages, degenerate groups
    reconcile.py   a rollout's turns -> training sequences (append on a clean prefix, fork otherwise)
    metrics.py     a scored group -> the reference's rollout metrics
    chat/          chat-template rendering, incremental and prefix-checked

Who talks to it: the trainer (harness/training/) starts the worker and reads its queue; the worker talks to
generation servers through harness/generation/ and to environments, tools and sandboxes. Nothing here
imports harness/training/ (tests/test_import_contract.py checks it).
"""

from harness._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AsyncRolloutLoop": "harness.rollout.loop",
    "InfrastructureFailure": "harness.rollout.loop",
    "RolloutWorker": "harness.rollout.worker",
    "RolloutWorkerError": "harness.rollout.worker",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

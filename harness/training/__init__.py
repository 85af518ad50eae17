"""The training side: what the trainer processes (ranks) run, on the GPUs.

    trainer.py          AsyncGRPOTrainer: the run (train) and one step (pull, plan, forward/backward, step)
    generation_side.py  what a run starts around its loop: the generation server, weight sync, the worker
    checkpointing.py    checkpoints and resuming, on any number of processes
    fsdp.py             FSDP2 sharding, full state dicts, broadcasts from rank 0
    attention.py        tree attention over packed rows (registered with transformers)
    logprobs.py         chunked log-probs and entropy at trained tokens only
    loss.py             score centering and the clipped surrogate, with masked importance sampling
    moe.py              the load-balancing loss of mixture-of-experts models
    flops.py            model FLOPs and the device's peak, for MFU

Who talks to it: users construct AsyncGRPOTrainer; it starts the rollout worker (harness/rollout/), pushes
weights through harness/weight_sync/ and reads samples planned by harness/packing.py.
"""

from harness._lazy import lazy_exports

_EXPORTS: dict[str, str] = {"AsyncGRPOTrainer": "harness.training.trainer"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

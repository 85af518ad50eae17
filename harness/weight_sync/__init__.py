"""Weight sync: how the trainer's policy reaches the generation servers after a step.

    plan.py         the choice, once at start (plan_weight_sync, from a server's /server_info)
    strategies.py   AdapterWeightSync (versioned LoRA adapters) and MergedWeightSync (pause, transfer,
                    resume)
    transports.py   how merged weights cross: a shared-memory file, or a broadcast group
    wire.py         what crosses to the server, on both sides: the manifest, the shared-memory file, the
                    torch.distributed broadcast group
    deltas.py       after the first broadcast to the built-in server, each tensor's changed elements alone
                    (AsyncGRPOConfig.weight_sync_deltas)
    vllm_nccl.py    vLLM's NCCL weight-transfer group and request bodies
    peft.py         a PEFT model's weights as the server loads them (LoRA merged in, base names)
    gather.py       under FSDP2, those weights gathered to rank 0 in buckets (one collective per bucket)

Who talks to it: harness/training/ opens a strategy at start and calls sync() every weight_sync_steps;
the strategies drive the server through harness/generation/; the built-in server (harness/server/) reads
what wire.py writes.
"""

from harness._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AdapterWeightSync": "harness.weight_sync.strategies",
    "MergedWeightSync": "harness.weight_sync.strategies",
    "WeightManifest": "harness.weight_sync.wire",
    "WeightSync": "harness.weight_sync.strategies",
    "WeightSyncPlan": "harness.weight_sync.plan",
    "plan_weight_sync": "harness.weight_sync.plan",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

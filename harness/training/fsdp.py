"""FSDP2 for the trainer's processes: how the policy is sharded, and its mixed precision.

With more than one process (`accelerate launch` / `torchrun`) the trainer shards the policy with PyTorch's
`fully_shard` (FSDP2) itself, on every device type, because accelerate only builds its FSDP plugin for
accelerator devices (on CPU it drops it and would leave the ranks training unsynchronised replicas). An
accelerate FSDP config (`fsdp_version: 2`) still chooses the settings: its `reshard_after_forward`,
`mixed_precision_policy` and `cpu_offload` are used when present.

The layout is accelerate's (`fsdp2_prepare_model`) with one change, the root:

    each decoder layer (a class in `model._no_split_modules`)      one group, resharded after forward
    tail: final norm + lm_head (+ input embedding when tied)       one group, kept unsharded until backward
    the decoder (`model.get_decoder()`): the input embedding       the root group

The trainer's forward is the decoder alone (`harness.training.attention.packed_forward`); the log-prob head
reads `lm_head.weight` afterwards, over the trained tokens only (`harness.training.logprobs`). So the decoder
must be the FSDP root (the first module to run forward is the root, and a multi-module group cannot be one),
and the head's weight must still be unsharded when the loss reads it: the tail group is all-gathered when the
final norm runs and, with `reshard_after_forward=False`, stays a plain (unsharded) parameter until its
post-backward, which reduce-scatters the gradient the fused head gave it like any other.

Mixed precision, as the reference describes it: with `bf16` (or `fp16`) every trainable parameter is
upcast to float32 before sharding, so the master weights and the optimizer state are float32 whatever
`dtype` the model was loaded in, while the forward and backward run in bf16 (fp16). Gradients are reduced in
float32 (an accelerate config's own policy, when it sets one, wins). Without mixed precision the parameters
keep their dtype.

Checkpoints stay the trainer's usual files (safetensors or a PEFT adapter, optimizer.pt), written from full
state dicts that every process helps gather (`full_state_dicts`). On resume rank 0 loads the weights into its
full model before sharding, the way one process does, and broadcasts them (`broadcast_from_rank0`, after
`use_float32_master_weights`, so float32 weights saved under mixed precision load losslessly); the
optimizer state is read back by rank 0 and broadcast into the shards (`load_full_optimizer_state_dict`).

Gradients: FSDP2 averages them over the processes; the loss is normalised by the trained tokens of the
whole micro-batch across processes, so the trainer multiplies each rank's loss by the world size and the
average becomes the sum the reference's normalisation needs (see `harness.training.loss`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "broadcast_from_rank0",
    "full_state_dicts",
    "is_sharded",
    "load_full_optimizer_state_dict",
    "mixed_precision_policy",
    "shard_model",
    "use_float32_master_weights",
]


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` (or any FSDP2 `fully_shard`) has been applied to the model's decoder."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model.get_decoder(), FSDPModule) or isinstance(model, FSDPModule)


def mixed_precision_policy(bf16: bool, fp16: bool) -> Any:
    """The FSDP2 policy for the config's precision flags: compute in bf16/fp16, reduce in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16 or fp16:
        dtype = torch.bfloat16 if bf16 else torch.float16
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: nn.Module,
    *,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    offload_policy: Any = None,
    mesh: Any = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 in the layout of the module docstring; returns it.

    Needs the default process group. Create the optimizer afterwards: the parameters become DTensors.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if is_sharded(model):
        return model
    mp_policy = mp_policy or MixedPrecisionPolicy()
    use_float32_master_weights(model, mp_policy)
    kwargs: dict[str, Any] = {"mp_policy": mp_policy, "offload_policy": offload_policy or OffloadPolicy()}
    if mesh is not None:
        kwargs["mesh"] = mesh
    decoder = model.get_decoder()
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [module for module in decoder.modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"cannot shard {type(model).__name__}: no decoder layer of the classes {sorted(layer_classes)}"
        )
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"cannot shard {type(model).__name__}: its decoder has no final `norm`")
    tail = [m for m in ([norm, embed, head] if tied else [norm, head]) if m is not None]
    fully_shard([m for m in tail if not isinstance(m, FSDPModule)], reshard_after_forward=False, **kwargs)
    fully_shard(decoder, **kwargs)
    return model


def use_float32_master_weights(model: nn.Module, mp_policy: Any) -> None:
    """Under a mixed-precision policy (a `param_dtype`), upcast every trainable parameter to float32: the
    master weights the optimizer steps. Idempotent; `shard_model` calls it."""
    if mp_policy is None or mp_policy.param_dtype is None:
        return
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.to(torch.float32)


def broadcast_from_rank0(tensors: Any) -> None:
    """Overwrite each (unsharded) tensor in place with rank 0's, in order, on every process. A collective."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor.data, src=0)


def full_state_dicts(
    model: nn.Module, optimizer: Any, *, trainable_only: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's full (unsharded) state dicts, on the CPU of rank 0 only.

    A collective: every process calls it. The others get empty dicts. Used to write a checkpoint that a run
    with any number of processes can read (the trainer's usual files: safetensors and optimizer.pt).
    `trainable_only` leaves the frozen parameters out of the model's (a PEFT model's base).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def load_full_optimizer_state_dict(model: nn.Module, optimizer: Any, optimizer_state: dict[str, Any]) -> None:
    """Load a full optimizer state dict that rank 0 read (the others pass an empty dict) into the optimizer of
    the sharded model: rank 0 broadcasts it and every process keeps its shard. A collective.

    Rank 0's state is `full_state_dicts`' (keyed by parameter name) or a one-process optimizer's
    `state_dict()` (keyed by position), as a one-process run's checkpoint holds it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    optimizer_state = _keyed_by_name(model, optimizer, optimizer_state)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def _keyed_by_name(model: nn.Module, optimizer: Any, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter position (`Optimizer.state_dict()`) keyed by parameter name
    instead, as torch.distributed.checkpoint reads it; one keyed by name (or empty) as it is."""
    groups = optimizer_state.get("param_groups", [])
    if all(isinstance(key, str) for group in groups for key in group["params"]):
        return optimizer_state
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    by_position = [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
    return {
        "state": {by_position[index]: state for index, state in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [by_position[index] for index in group["params"]]} for group in groups
        ],
    }

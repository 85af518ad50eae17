"""The weights a generation server needs from a (possibly LoRA-wrapped) policy, one tensor at a time.

A server loads the base checkpoint's parameter names. For a plain model those are its own
`named_parameters()`. For a PEFT model the adapter is merged on the fly: each LoRA-wrapped linear layer
yields `W + scaling * B @ A` under the base layer's name, computed for that layer only, so the whole
model never exists twice in memory. Adapter-only parameters and PEFT's name prefixes are not sent.

Under FSDP2 the parameters are gathered in buckets to rank 0 (harness/weight_sync/gather.py), a layer's
base weight with its LoRA factors, and rank 0 merges them with PEFT's own `get_delta_weight` on the full
tensors, as one process does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from harness.weight_sync.gather import DEFAULT_GATHER_BUCKET_BYTES

if TYPE_CHECKING:
    from harness.weight_sync.gather import GatherItem

_PEFT_PREFIX = "base_model.model."


def served_parameters(model: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(checkpoint name, parameter) of every parameter a server loads: a PEFT model's base parameters under
    the base checkpoint's names (adapter-only parameters left out), a plain model's as they are; of a
    vision-language model only its text model's (the frozen vision tower stays as the server loaded it)."""
    from harness.model_loading import is_served_text_parameter

    peft = hasattr(model, "peft_config")
    served = is_served_text_parameter(model)
    for name, parameter in model.named_parameters():
        if peft and (".lora_" in name or "modules_to_save" in name):
            continue
        if not served(parameter):
            continue
        yield (_checkpoint_name(name) if peft else name), parameter


@torch.no_grad()
def merged_named_parameters(
    model: Any,
    *,
    bucket_size_bytes: int | None = DEFAULT_GATHER_BUCKET_BYTES,
    all_ranks: bool = False,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`served_parameters` as full tensors, in order, LoRA deltas merged in; floating tensors wider than
    `dtype` cast to it (the server's: it would round them so on copy anyway), and under FSDP2 cast before
    they are gathered, so a float32 policy synced to a bf16 server gathers and sends half the bytes. A LoRA
    layer's weight is merged in its own dtype, then cast.

    One process: each parameter as it is (merged where LoRA wraps it), one at a time. Under FSDP2 a
    collective that every process iterates to the end: the tensors are gathered in buckets of
    `bucket_size_bytes` to rank 0, which alone gets them (with `all_ranks`, every process gets them).
    `bucket_size_bytes=None` gathers each parameter on its own on every process (`DTensor.full_tensor()`,
    one collective per parameter, and more per LoRA layer).
    """
    lora_layers = _lora_layers(model)
    served = list(served_parameters(model))
    if bucket_size_bytes is not None and any(_is_sharded(parameter) for _, parameter in served):
        from harness.weight_sync.gather import gather_in_buckets

        items = [
            _gather_item(name, parameter, lora_layers.get(id(parameter)), dtype) for name, parameter in served
        ]
        yield from gather_in_buckets(items, bucket_size_bytes, all_ranks=all_ranks)
        return
    for name, parameter in served:
        tensor = _full(parameter.detach())
        layer = lora_layers.get(id(parameter))
        if layer is not None and layer.active_adapters:
            # merged for this layer only, just before it is sent (under FSDP2 the delta is computed from the
            # sharded adapter and gathered like the weight)
            delta = _full(layer.get_delta_weight(layer.active_adapters[0]))
            tensor = tensor + delta.to(tensor.dtype)
        yield name, narrowed(tensor, dtype)


def narrowed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` cast to `dtype` when both are floating and `dtype` is narrower; else `tensor` as it is."""
    target = _narrower(tensor.dtype, dtype)
    return tensor if target is None else tensor.to(target)


def sent_dtype(source: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype `source` is sent in by `merged_named_parameters(..., dtype=dtype)`."""
    return _narrower(source, dtype) or source


def _narrower(source: torch.dtype, dtype: torch.dtype | None) -> torch.dtype | None:
    if dtype is None or not (source.is_floating_point and dtype.is_floating_point):
        return None
    return dtype if dtype.itemsize < source.itemsize else None


def _lora_layers(model: Any) -> dict[int, Any]:
    """The unmerged LoRA layers of a PEFT model, by the id of their base weight; {} for a plain model."""
    if not hasattr(model, "peft_config"):
        return {}
    return {
        id(module.base_layer.weight): module
        for module in model.modules()
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and not module.merged
    }


def _gather_item(
    name: str, parameter: torch.nn.Parameter, layer: Any, dtype: torch.dtype | None
) -> GatherItem:
    """A served parameter for the bucketed gather, cast to `dtype` (when narrower) before it travels; or with
    its LoRA layer's factors of the active adapter, which rank 0 merges into it once all are full and then
    casts."""
    from harness.weight_sync.gather import GatherItem

    if layer is None or not layer.active_adapters:
        return GatherItem(name, (parameter.detach(),), dtype=_narrower(parameter.dtype, dtype))
    adapter = layer.active_adapters[0]
    factors = {
        key: factor.detach()
        for key, factor in layer.named_parameters()
        if not key.startswith("base_layer.") and adapter in key.split(".")
    }
    keys = list(factors)

    def merge(full: list[torch.Tensor]) -> torch.Tensor:
        tensor, *full_factors = full
        delta = _delta_weight(layer, adapter, dict(zip(keys, full_factors, strict=True)))
        return narrowed(tensor + delta.to(tensor.dtype), dtype)

    return GatherItem(name, (parameter.detach(), *factors.values()), merge)


def _delta_weight(layer: Any, adapter: str, factors: dict[str, torch.Tensor]) -> torch.Tensor:
    """PEFT's `layer.get_delta_weight(adapter)` computed from these full factors (by the layer's parameter
    names) in place of the layer's own (sharded) ones, which are swapped back afterwards."""
    from torch.func import functional_call

    return functional_call(
        _DeltaWeight(layer), {f"layer.{key}": factor for key, factor in factors.items()}, (adapter,)
    )


class _DeltaWeight(torch.nn.Module):
    """Calls the layer's `get_delta_weight` as a forward, so `functional_call` can swap its parameters."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, adapter: str) -> torch.Tensor:
        return self.layer.get_delta_weight(adapter)


def _is_sharded(parameter: torch.Tensor) -> bool:
    return hasattr(parameter, "full_tensor")


def _checkpoint_name(name: str) -> str:
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) parameter gathered; a plain one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

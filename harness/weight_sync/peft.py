"""The weights a generation server needs from a (possibly LoRA-wrapped) policy, one tensor at a time.

A server loads the base checkpoint's parameter names. For a plain model those are its own
`named_parameters()`. For a PEFT model the adapter is merged on the fly: each LoRA-wrapped linear layer
yields `W + scaling * B @ A` under the base layer's name, computed for that layer only, so the whole
model never exists twice in memory. Adapter-only parameters and PEFT's name prefixes are not sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

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
def merged_named_parameters(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """`served_parameters` as full tensors, one at a time, LoRA deltas merged in."""
    lora_layers = {}
    if hasattr(model, "peft_config"):
        lora_layers = {
            id(module.base_layer.weight): module
            for module in model.modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer") and not module.merged
        }
    for name, parameter in served_parameters(model):
        tensor = _full(parameter.detach())
        layer = lora_layers.get(id(parameter))
        if layer is not None and layer.active_adapters:
            # merged for this layer only, just before it is sent (under FSDP2 the delta is computed from the
            # sharded adapter and gathered like the weight)
            delta = _full(layer.get_delta_weight(layer.active_adapters[0]))
            tensor = tensor + delta.to(tensor.dtype)
        yield name, tensor


def _checkpoint_name(name: str) -> str:
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) parameter gathered; a plain one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

"""LoRA adapters for the built-in server: loaded from a PEFT directory, applied per request.

Who talks to it: the HTTP layer's /v1/load_lora_adapter and /v1/unload_lora_adapter run `LoraManager.load` /
`unload` on the engine thread; a completion request naming an adapter carries the `LoraAdapter` into the
engine, which lists, for each forward pass, which batch entries use which adapter
(`ForwardBatch.lora_groups`). Forward hooks on the targeted linear layers then add
`scale * x @ A^T @ B^T` to the rows of that adapter only, so requests for different adapters and for the
base model share one batch. The base weights are never modified (no merging), so an adapter can be
unloaded while another request still uses it: a request keeps its adapter object until it finishes.

Format: a PEFT LoRA directory, `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `alpha_pattern`)
and `adapter_model.safetensors` with `...<module>.lora_A.weight` [r, in] and `...<module>.lora_B.weight`
[out, r]. Refused with `LoraError`: DoRA, LoRA on embeddings, trained biases, `modules_to_save`, and
modules the model does not have.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from harness.server.kv_cache import current_batch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class LoraError(ValueError):
    """An adapter cannot be loaded (bad directory, unsupported feature, unknown module)."""


@dataclass
class LoraLayer:
    """One adapted linear layer: A [r, in] and B [out, r], on the model's device and dtype."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scale: float


@dataclass
class LoraAdapter:
    """A loaded adapter: its name, where it came from and its layers by module name."""

    name: str
    path: str
    rank: int
    layers: dict[str, LoraLayer]


def read_adapter(name: str, path: str | Path, model: PreTrainedModel) -> LoraAdapter:
    """Load and check a PEFT LoRA directory against `model`."""
    directory = Path(path)
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise LoraError(f"{directory}: no adapter_config.json (is this a PEFT LoRA directory?)")
    config: dict[str, Any] = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{directory}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if config.get(flag):
            raise LoraError(f"{directory}: {flag}=true is not supported by the built-in server")
    if config.get("modules_to_save"):
        raise LoraError(f"{directory}: modules_to_save is not supported by the built-in server")
    weights_path = directory / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoraError(f"{directory}: no adapter_model.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(str(weights_path))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraError(f"{directory}: unsupported tensor {key!r} (only lora_A / lora_B weights)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    modules = dict(model.named_modules())
    alpha = float(config.get("lora_alpha", 8))
    alpha_pattern: dict[str, float] = config.get("alpha_pattern") or {}
    use_rslora = bool(config.get("use_rslora", False))
    param = next(model.parameters())
    layers: dict[str, LoraLayer] = {}
    rank = 0
    for module_name, pair in parts.items():
        module = modules.get(module_name)
        if not isinstance(module, torch.nn.Linear):
            raise LoraError(f"{directory}: the model has no linear layer {module_name!r}")
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{directory}: {module_name} lacks lora_{'B' if 'A' in pair else 'A'}")
        lora_A, lora_B = pair["A"], pair["B"]
        r = lora_A.shape[0]
        if lora_A.shape != (r, module.in_features) or lora_B.shape != (module.out_features, r):
            raise LoraError(
                f"{directory}: {module_name} has A {tuple(lora_A.shape)} and B {tuple(lora_B.shape)}, "
                "which do "
                f"not fit a {module.in_features}->{module.out_features} layer"
            )
        layer_alpha = next(
            (
                float(a)
                for pattern, a in alpha_pattern.items()
                if re.fullmatch(rf"(.*\.)?{pattern}", module_name)
            ),
            alpha,
        )
        scale = layer_alpha / (math.sqrt(r) if use_rslora else r)
        layers[module_name] = LoraLayer(
            lora_A=lora_A.to(device=param.device, dtype=param.dtype),
            lora_B=lora_B.to(device=param.device, dtype=param.dtype),
            scale=scale,
        )
        rank = max(rank, r)
    if not layers:
        raise LoraError(f"{directory}: the adapter has no LoRA weights")
    return LoraAdapter(name=name, path=str(directory), rank=rank, layers=layers)


class LoraManager:
    """The adapters a server has loaded, and the hooks that apply them.

    Args:
        model: The served model.
        max_loras: Most adapters loaded at once.
        max_lora_rank: Largest rank accepted.
    """

    def __init__(self, model: PreTrainedModel, *, max_loras: int = 8, max_lora_rank: int = 64) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, LoraAdapter] = {}
        self._hooked: set[str] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        if name in self.adapters:
            raise LoraError(
                f"an adapter named {name!r} is already loaded (load new versions under new names)"
            )
        if len(self.adapters) >= self.max_loras:
            raise LoraError(f"{self.max_loras} adapters are loaded already (max_loras); unload one first")
        adapter = read_adapter(name, path, self.model)
        if adapter.rank > self.max_lora_rank:
            raise LoraError(f"adapter rank {adapter.rank} is over max_lora_rank {self.max_lora_rank}")
        modules = dict(self.model.named_modules())
        for module_name in adapter.layers:
            if module_name not in self._hooked:
                self._handles.append(modules[module_name].register_forward_hook(_make_hook(module_name)))
                self._hooked.add(module_name)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget the adapter; requests already running with it finish with it."""
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self.adapters.clear()


def _make_hook(module_name: str):
    def add_lora(
        module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor:
        batch = current_batch()
        if batch is None or not batch.lora_groups:
            return output
        x = inputs[0]
        for adapter, index in batch.lora_groups:
            layer = adapter.layers.get(module_name)
            if layer is None:
                continue
            delta = (x.index_select(0, index) @ layer.lora_A.T) @ layer.lora_B.T
            output.index_add_(0, index, delta, alpha=layer.scale)
        return output

    return add_lora

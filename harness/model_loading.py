"""Loading a policy checkpoint, text-only or vision-language, the same way on both sides of the split.

A checkpoint is loaded with the architecture its config declares: `AutoModelForImageTextToText` for a
vision-language one (Qwen3.5, Qwen3.6, Qwen3-VL: a config with a `vision_config`), `AutoModelForCausalLM`
otherwise. The trainer and the built-in server both load through `load_model`, so their parameter names
are the checkpoint's (`model.language_model.*` for Qwen3.5), which is also what vLLM loads and what weight
sync sends.

A vision-language policy trains on text: `freeze_outside_text_model` turns off gradients for everything
outside its language model and LM head (the vision tower, the multimodal projector), so those get no
gradients and no optimizer state, and `is_served_text_parameter` lets weight sync skip them, leaving the
server with the values it loaded. The tower is still loaded and costs memory for its weights.

    model = load_model(path, dtype=torch.bfloat16)
    frozen = freeze_outside_text_model(model)     # names of the frozen parameters ([] for a text model)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "freeze_outside_text_model",
    "is_served_text_parameter",
    "is_vision_language",
    "load_model",
    "outside_text_modules",
]


def is_vision_language(config: Any) -> bool:
    """Whether a (loaded) config describes a vision-language model: it has a vision tower's config."""
    return getattr(config, "vision_config", None) is not None


def load_model(path: str, **kwargs: Any) -> Any:
    """The checkpoint at `path` with the architecture its config declares (see the module docstring);
    `kwargs` go to `from_pretrained` (dtype, trust_remote_code, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
    loader = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return loader.from_pretrained(path, **kwargs)


def _text_parameter_ids(model: Any) -> set[int]:
    ids = {id(p) for p in model.get_decoder().parameters()}
    head = model.get_output_embeddings()
    if head is not None:
        ids.update(id(p) for p in head.parameters())
    return ids


def freeze_outside_text_model(model: Any) -> list[str]:
    """For a vision-language model, requires_grad=False on every parameter outside its language model and
    LM head; returns their names ([] for a text-only model, which is left as it is)."""
    if not is_vision_language(model.config):
        return []
    text = _text_parameter_ids(model)
    frozen = []
    for name, parameter in model.named_parameters():
        if id(parameter) not in text:
            parameter.requires_grad_(False)
            frozen.append(name)
    return frozen


def outside_text_modules(model: Any) -> list[str]:
    """The topmost modules with parameters wholly outside the text model (e.g. ["model.visual"])."""
    if not is_vision_language(model.config):
        return []
    text = _text_parameter_ids(model)
    names: list[str] = []
    for name, module in model.named_modules():
        parameters = list(module.parameters())
        if not name or not parameters or any(id(p) in text for p in parameters):
            continue
        if not any(name.startswith(f"{outer}.") for outer in names):
            names.append(name)
    return names


def is_served_text_parameter(model: Any) -> Any:
    """A predicate on parameters: True for those weight sync sends (all of a text-only model's; a
    vision-language model's language model and LM head only)."""
    if not is_vision_language(getattr(model, "config", None)):
        return lambda parameter: True
    text = _text_parameter_ids(model)
    return lambda parameter: id(parameter) in text

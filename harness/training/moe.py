"""Mixture-of-Experts load balancing: which policies route tokens to experts, and their auxiliary loss.

A MoE model's router sends each token to `num_experts_per_tok` of its experts; the load-balancing loss of
the Switch Transformer (transformers' `load_balancing_loss_func`, the one its MoE causal LMs add to their
loss) pushes the routing towards an even load. The trainer forwards a MoE policy's packed rows with
`harness.training.attention.packed_forward(..., output_router_logits=True)`, takes `router_aux_loss` over each
row's tokens (a prefix shared by a row's samples counts once, as it is forwarded once), and adds
`coef * aux_loss` to the row's loss, weighted so that the step's gradient is `coef` times the mean of
the rows' losses (harness/training/trainer.py, `_train_on_plan`).

    coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)   # 0.0: nothing to add
    hidden_T_H, router_logits = packed_forward(model, row, output_router_logits=True)
    aux_loss = router_aux_loss(router_logits, model.config)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["is_moe_config", "router_aux_loss", "router_aux_loss_coef"]


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _experts(config: Any) -> tuple[int, int] | None:
    """(experts, experts per token) of a MoE config, or None for a dense model."""
    config = _text_config(config)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (int(num_experts), int(top_k)) if num_experts and top_k else None


def is_moe_config(config: Any) -> bool:
    """Whether a model config (or a multimodal config's text config) declares routed experts.

    Detected as transformers' MoE configs declare them: `num_experts` (Qwen2-MoE, Qwen3-MoE, Qwen3-Next)
    or `num_local_experts` (Mixtral, GPT-OSS), with `num_experts_per_tok`.
    """
    return _experts(config) is not None


def router_aux_loss_coef(config: Any, configured: float | None) -> float:
    """The weight of the load-balancing loss: `configured` if set, else the model config's (0.0 if none).

    Raises ValueError when `configured` is set for a dense model, which has no router to balance.
    """
    if not is_moe_config(config):
        if configured is not None:
            raise ValueError(
                f"router_aux_loss_coef={configured} is set but the model is not a Mixture-of-Experts model "
                "(its config declares no num_experts / num_local_experts with num_experts_per_tok): leave "
                "router_aux_loss_coef unset"
            )
        return 0.0
    if configured is not None:
        return float(configured)
    return float(getattr(_text_config(config), "router_aux_loss_coef", None) or 0.0)


def router_aux_loss(router_logits_L: Sequence[torch.Tensor], config: Any) -> torch.Tensor:
    """The load-balancing loss of one forward, unscaled: a 0-dim float32 tensor with its gradient.

    `router_logits_L` holds one [T, num_experts] tensor per MoE layer (`packed_forward`'s second output).
    transformers' function, copied unchanged into every MoE model it ships, is taken from Mixtral.
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = _experts(config)
    if experts is None:
        raise ValueError("router_aux_loss needs a Mixture-of-Experts config (see is_moe_config)")
    if not router_logits_L:
        raise ValueError("no router logits: the forward ran no MoE layer")
    num_experts, top_k = experts
    return load_balancing_loss_func(tuple(router_logits_L), num_experts, top_k)

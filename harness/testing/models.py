"""Tiny random models built from configs: Qwen3, Qwen3-MoE, Llama, the Qwen3.5 gated-DeltaNet hybrid, and
Qwen3.5's vision-language form (its text model beside a tiny vision tower)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3_5VisionConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from harness.testing.bytelevel import ENDOFTEXT, IM_END
from harness.testing.tiny_tokenizer import tiny_vocab_info


def _token_ids(vocab_size: int | None) -> dict[str, int | None]:
    """Vocabulary size and bos/eos/pad ids shared by all tiny configs, taken from the tiny tokenizer.

    As in Qwen's configs, bos is <|endoftext|>; the tokenizer itself adds no bos token. An id that does not
    fit a smaller `vocab_size` becomes None (the embedding would reject it as padding index). When pairing a
    tiny model with another tokenizer, pass that tokenizer's ids as config overrides.
    """
    size, ids = tiny_vocab_info()
    vocab_size = size if vocab_size is None else vocab_size
    bos, eos, pad = ids[ENDOFTEXT], ids[IM_END], ids[ENDOFTEXT]
    return {
        "vocab_size": vocab_size,
        "bos_token_id": bos if bos < vocab_size else None,
        "eos_token_id": eos if eos < vocab_size else None,
        "pad_token_id": pad if pad < vocab_size else None,
    }


# The dimensions of real Qwen3 checkpoints, for random models of their shape (benchmarks). The vocabulary is
# Qwen's 151,936 ids, embeddings tied.
QWEN3_SHAPES: dict[str, dict[str, int]] = {
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
QWEN_VOCAB_SIZE = 151936


def _tiny_decoder_params(vocab_size: int | None) -> dict[str, Any]:
    """The dimensions the tiny Qwen3, Qwen3-MoE and Llama share: 2 layers, hidden size 64, 4 query heads and
    2 KV heads of dim 16, untied embeddings."""
    return {
        **_token_ids(vocab_size),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def tiny_qwen3_config(*, vocab_size: int | None = None, **overrides: Any) -> Qwen3Config:
    """Config of a 2-layer Qwen3, hidden size 64 (4 query heads, 2 KV heads of dim 16); `overrides` win."""
    return Qwen3Config(**{**_tiny_decoder_params(vocab_size), **overrides})


def tiny_qwen3_moe_config(*, vocab_size: int | None = None, **overrides: Any) -> Qwen3MoeConfig:
    """Config of a 2-layer Qwen3-MoE, hidden size 64, both layers routing each token to 2 of 4 experts.

    Attention as in `tiny_qwen3_config`; experts of intermediate size 32; `overrides` win.
    """
    params = {
        **_tiny_decoder_params(vocab_size),
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    return Qwen3MoeConfig(**{**params, **overrides})


def tiny_llama_config(*, vocab_size: int | None = None, **overrides: Any) -> LlamaConfig:
    """Config of a 2-layer Llama, hidden size 64 (4 query heads, 2 KV heads of dim 16); `overrides` win."""
    return LlamaConfig(**{**_tiny_decoder_params(vocab_size), **overrides})


def _hybrid_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's pattern (every 4th layer full attention, the rest gated DeltaNet), ending on full attention.

    Ending on a full-attention layer keeps both kinds present even in 2- or 3-layer models.
    """
    return [
        "full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "linear_attention"
        for i in range(num_layers)
    ]


def tiny_qwen3_5_config(
    *, vocab_size: int | None = None, num_hidden_layers: int = 4, **overrides: Any
) -> Qwen3_5TextConfig:
    """Config of a Qwen3.5 text model, hidden size 64, mixing gated-DeltaNet and full-attention layers.

    The default 4 layers are [linear, linear, linear, full], the real Qwen3.5 3:1 pattern; other depths
    follow `_hybrid_layer_types` unless `layer_types` is overridden.
    """
    params: dict[str, Any] = {
        **_token_ids(vocab_size),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_hidden_layers,
        "layer_types": _hybrid_layer_types(num_hidden_layers),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    return Qwen3_5TextConfig(**{**params, **overrides})


def _build(
    model_class: type[PreTrainedModel], config: PreTrainedConfig, seed: int, dtype: torch.dtype
) -> PreTrainedModel:
    """Instantiate with weights drawn from `seed`, cast to `dtype`, and switch to eval mode.

    The seeding happens on a forked CPU RNG, so building a model does not disturb the caller's random stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(dtype=dtype).eval()


def build_tiny_qwen3(
    *, vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Qwen3ForCausalLM:
    """A random tiny Qwen3ForCausalLM (see `tiny_qwen3_config`), in eval mode, deterministic for a seed."""
    return _build(Qwen3ForCausalLM, tiny_qwen3_config(vocab_size=vocab_size, **overrides), seed, dtype)


def build_tiny_qwen3_moe(
    *, vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Qwen3MoeForCausalLM:
    """A random tiny Qwen3MoeForCausalLM (see `tiny_qwen3_moe_config`), in eval mode, seeded."""
    return _build(Qwen3MoeForCausalLM, tiny_qwen3_moe_config(vocab_size=vocab_size, **overrides), seed, dtype)


def build_tiny_llama(
    *, vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> LlamaForCausalLM:
    """A random tiny LlamaForCausalLM (see `tiny_llama_config`), in eval mode, deterministic for a seed."""
    return _build(LlamaForCausalLM, tiny_llama_config(vocab_size=vocab_size, **overrides), seed, dtype)


def build_tiny_qwen3_5(
    *, vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Qwen3_5ForCausalLM:
    """A random tiny hybrid Qwen3_5ForCausalLM (gated DeltaNet + full attention), in eval mode.

    Without the optional fla / causal-conv1d kernels (e.g. on CPU) transformers runs the pure-torch
    gated-delta-rule fallback, which is what the tests exercise.
    """
    return _build(Qwen3_5ForCausalLM, tiny_qwen3_5_config(vocab_size=vocab_size, **overrides), seed, dtype)


def tiny_qwen3_5_vl_config(*, vocab_size: int | None = None, **text_overrides: Any) -> Qwen3_5Config:
    """Config of a Qwen3.5 vision-language model: `tiny_qwen3_5_config`'s text model (overrides go there)
    and a one-block vision tower of width 32 projecting into it."""
    text = tiny_qwen3_5_config(vocab_size=vocab_size, **text_overrides)
    vision = Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text.hidden_size,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=1,
    )
    return Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        tie_word_embeddings=text.tie_word_embeddings,
    )


def build_tiny_qwen3_5_vl(
    *, vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, **text_overrides: Any
) -> Qwen3_5ForConditionalGeneration:
    """A random tiny Qwen3_5ForConditionalGeneration (a vision tower beside the hybrid text model), in eval
    mode: what the reference's Qwen3.5 checkpoints load as. `layer_types=["full_attention"] * 4` gives a
    text model the built-in server can serve."""
    return _build(
        Qwen3_5ForConditionalGeneration,
        tiny_qwen3_5_vl_config(vocab_size=vocab_size, **text_overrides),
        seed,
        dtype,
    )

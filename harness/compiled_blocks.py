"""Compiled blocks: each decoder layer's RMSNorms and dense gated MLP run through `torch.compile`.

Between the matmuls of a decoder layer sits a chain of elementwise work that eager PyTorch runs as one
kernel each, forward and backward: an RMSNorm is an upcast, a square, a mean, a reciprocal square root and
two multiplies; a gated MLP's `act(gate) * up` is three more. Compiling those modules fuses each chain into
a kernel or two. The attention is left alone: it has its own kernels (`harness.training.attention`) and a
trie-shaped plan that changes with every row, which a compiled graph would have to guard on.

New row lengths reuse the compiled code: the modules are compiled with dynamic shapes, so the token dimension
is symbolic. Instances of one class share it too (nn modules are traced as inputs, not constants), so a
28-layer model compiles one graph per module class and shape of weight (for Qwen3 three: the hidden-size
norms, the head-dim q/k norms, the MLP; a Qwen3.5 hybrid four; under FSDP2 the final norm, sharded with the
head, one more), paid in the trainer's warm-up at start (about 8 s on an H200). Those graphs all hang off one
code object per class (`Qwen3RMSNorm.forward`), so dynamo's limit of cached graphs per code object (8 by
default, beyond which it runs the code eagerly) is raised to `RECOMPILE_LIMIT`. Inductor may still specialise
a kernel on a size range, so a row that first crosses such a bound (4,096 tokens, say) compiles that graph
once more, in about a second: a tiny model's rows of 64 to 20,000 tokens compiled 5 graphs in all on CPU
(tests/test_gpu_training_core.py counts them on a GPU).

Measured on one H200 (benchmarks/bench_packing.py --sweep, random Qwen3-1.7B, bf16, tree-packed rows, the
same step with the compiled modules run eagerly beside it): 14-18% less time per step from 8k to 32k tokens
with gradient checkpointing (8% at 4k), 17-24% without, where the peak memory of a 32k row also fell from
106.5 to 71.2 GiB (fused kernels keep fewer intermediates for the backward).

What is compiled: modules whose class name ends in `RMSNorm`, and MLPs with `gate_proj`, `up_proj`,
`down_proj` (plain `nn.Linear`) and `act_fn`, wherever they sit (a vision tower's modules are compiled too,
but only a module that runs is ever traced). Left eager: an MLP whose projections are wrapped (a LoRA
adapter: PEFT's dispatch over active adapters would be guarded on and retraced as adapters merge for the
weight sync), the experts of a mixture-of-experts layer, and the gated RMSNorms of DeltaNet layers.

Who calls it: the trainer, once, after tree attention is prepared and before FSDP2 shards the layers
(`AsyncGRPOConfig.compile_blocks`: on by default on a CUDA device); the built-in server before its engine
starts (`ServerConfig.compile_blocks`: on by default on a CUDA device, off with `--enforce-eager`; compiled
in the engine's warm-up, `Engine.warm_up`), whose CUDA graphs then replay the fused kernels, and whose MLPs
stay eager when LoRA adapters may be loaded (their forward hooks go on the MLPs' projections, after the
compile); benchmarks/bench_packing.py and bench_engine.py.

Whole layers (`compile_layers`, the built-in server's `ServerConfig.compile_layers`): a decode step is ~30
kernels per layer, and between the compiled norms and MLP the attention block still launches one kernel per
elementwise op (the rotary embedding's multiplies, negations, concatenations and adds; the residual adds).
Compiling each decoder layer whole fuses those too, into two graphs a layer: everything before the
attention call, and everything after it. The attention itself, which reads and writes the server's row
cache (`harness.server.kv_cache.row_cache_attention`), is excluded from tracing (`torch.compiler.disable`):
the graph breaks around it. Taken: decoder layers (class name ending in `DecoderLayer`) with a `self_attn`
and a dense MLP of plain `nn.Linear` projections; any other layer, and the norms outside the layers (the
final norm), get `compile_blocks`' treatment. Off by default until measured on a GPU.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["RECOMPILE_LIMIT", "compilable_blocks", "compilable_layers", "compile_blocks", "compile_layers"]

RECOMPILE_LIMIT = 64  # graphs dynamo may cache per code object (module docstring)
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def compilable_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs `compile_blocks` compiles, outermost first."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if ".experts." not in f".{name}." and (_is_rms_norm(module) or _is_dense_mlp(module))
    ]


def compile_blocks(model: nn.Module, *, backend: Any = "inductor", mlps: bool = True) -> list[str]:
    """Compile every block `compilable_blocks` finds, in place, with dynamic shapes; returns their names.

    `backend` is torch.compile's (tests pass a counting or "aot_eager" backend on CPU); `mlps=False` compiles
    the norms only. Compilation itself happens at a module's first call.
    """
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    blocks = [(name, module) for name, module in compilable_blocks(model) if mlps or _is_rms_norm(module)]
    for _, module in blocks:
        module.compile(backend=backend, dynamic=True)
    return [name for name, _ in blocks]


def compilable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs of the decoder layers `compile_layers` compiles whole."""
    return [(name, module) for name, module in model.named_modules() if _is_whole_layer(module)]


def compile_layers(model: nn.Module, *, backend: Any = "inductor") -> list[str]:
    """Compile every decoder layer `compilable_layers` finds whole, and `compile_blocks`' blocks outside
    them, in place, with dynamic shapes; returns their names (module docstring). Compilation itself happens
    at a module's first call."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    layers = compilable_layers(model)
    inside = tuple(f"{name}." for name, _ in layers)
    blocks = [(name, module) for name, module in compilable_blocks(model) if not name.startswith(inside)]
    for _, module in layers + blocks:
        module.compile(backend=backend, dynamic=True)
    return [name for name, _ in layers + blocks]


def _is_whole_layer(module: nn.Module) -> bool:
    mlp = getattr(module, "mlp", None)
    return (
        type(module).__name__.endswith("DecoderLayer")
        and hasattr(module, "self_attn")
        and mlp is not None
        and _is_dense_mlp(mlp)
    )


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _is_dense_mlp(module: nn.Module) -> bool:
    projections = [getattr(module, name, None) for name in _MLP_PROJECTIONS]
    return hasattr(module, "act_fn") and all(type(p) is nn.Linear for p in projections)

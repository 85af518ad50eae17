"""Fused projections: each attention's query, key and value projections as one matmul, each dense MLP's
gate and up projections as another, in the built-in server's model.

Who talks to it: `ServerState.from_model`, once, before the model is compiled and the engine starts
(`ServerConfig.fuse_projections`: on by default on a GPU, never with LoRA adapters, whose forward hooks
sit on the separate projections).

Why: a decode step multiplies a few dozen rows by each weight. Such a matmul is a kernel launch and one
pass over its weight, too short to keep the GPU busy, and a decoder layer has seven: q, k, v, o, gate, up,
down. Multiplying once by the concatenated weights of q, k and v, and once by those of gate and up, reads
the same bytes in two kernels instead of five. vLLM's Qwen and Llama models are written with such merged
layers (`QKVParallelLinear`, `MergedColumnParallelLinear`); here the transformers model is left as it is
and its projections share storage instead. On one H100 (random Qwen3-0.6B in bf16, norms and MLPs
compiled, `benchmarks/bench_decode_step.py --compile-blocks [--no-fuse-projections]`) a graphed decode
step of 64 rows over 200 keys took 3.51 ms instead of 3.79 (750 kernels instead of 834), of 256 rows 6.33
instead of 6.62; over HTTP at 256 in flight the server gave 16,916 tokens/s instead of 15,858 (README).

How: each group's weights are copied into one tensor, rows of q then k then v (gate then up), and each
projection's `weight` parameter (and `bias`) becomes a view of its rows. Parameter names, shapes and
state dicts are unchanged, and a weight update that copies into a parameter in place
(`weight_sync.wire.copy_into_model`) writes the fused tensor, as the CUDA graphs need anyway. A dense MLP
(`gate_proj`, `up_proj`, `down_proj`, plain `nn.Linear`, and `act_fn`) gets a forward that multiplies once
and splits the result; it stays a dense MLP for `compiled_blocks`, whose compiled kernel then reads the
two halves. The attention's forward is transformers' own, which calls `q_proj`, `k_proj` and `v_proj` in
turn on one hidden-state tensor: those become `ProjectionSlice`s of one `FusedProjection`, and the first
slice called computes all three and keeps the other two results for the next calls with that same tensor
(an identity check, so a call with any other input computes its own slice alone and stays correct). Each
result is a view of the fused output: its last dimension is contiguous, so the attention's `view` into
heads works as on a projection's own output. Not fused: projections that are not plain `nn.Linear`, that
differ in input size, dtype, device or in having a bias.

The model must already be on its device, in its dtype: moving it afterwards (`model.to`) would give each
parameter storage of its own and leave the fused tensors stale. The server never moves a loaded model.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["FusedProjection", "ProjectionSlice", "fuse_projections"]

_ATTENTION = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


class FusedProjection:
    """The concatenated weight (and bias) of several projections of one input, and the results of the last
    input not yet handed out (module docstring). A plain object, not a module: the parameters stay the
    projections' own, under their own names."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight, self.bias = _share_storage(linears)
        self.sizes = [linear.out_features for linear in linears]
        self.parts = [(linear.weight, linear.bias) for linear in linears]  # views of the fused tensors
        self._input: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection `index` of `x`: from the results kept for `x` if the fused matmul already ran on it,
        else from a fused matmul now (the other results kept), or alone where one of them was already
        taken (a caller that projects one input twice)."""
        if self._input is x and index in self._pending:
            result = self._pending.pop(index)
            if not self._pending:
                self._input = None
            return result
        if self._input is x:  # this slice was already handed out for x: it alone, again
            return F.linear(x, *self.parts[index])
        parts = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self._input = x
        self._pending = {i: part for i, part in enumerate(parts) if i != index}
        return parts[index]


class ProjectionSlice(nn.Module):
    """One projection of a `FusedProjection`: its `weight` (and `bias`) parameters are views of the fused
    tensors, under the projection's own name, and its forward is its share of the fused matmul."""

    def __init__(self, fused: FusedProjection, index: int, linear: nn.Linear) -> None:
        super().__init__()
        self.fused = fused  # a plain object: not a submodule, so no parameters of its own in the state dict
        self.index = index
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight, self.bias = fused.parts[index]  # the linear's own, already views of the fused tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused part {self.index}"


def fuse_projections(model: nn.Module, *, attention: bool = True, mlps: bool = True) -> list[str]:
    """Fuse, in place, the q/k/v projections of every attention (`attention`) and the gate/up projections
    of every dense MLP (`mlps`) that allow it (module docstring); returns the fused modules' names."""
    fused = []
    for name, module in list(model.named_modules()):
        if attention and _fusable(module, _ATTENTION):
            group = FusedProjection([getattr(module, p) for p in _ATTENTION])
            for index, projection in enumerate(_ATTENTION):
                setattr(module, projection, ProjectionSlice(group, index, getattr(module, projection)))
            fused.append(name)
        elif mlps and _is_unfused_dense_mlp(module):
            _fuse_mlp(module)
            fused.append(name)
    return fused


def _is_unfused_dense_mlp(module: nn.Module) -> bool:
    return (
        hasattr(module, "act_fn")
        and type(getattr(module, "down_proj", None)) is nn.Linear
        and _fusable(module, _GATE_UP)
        and not hasattr(module, "gate_up_weight")  # fused already
    )


def _fusable(module: nn.Module, names: tuple[str, ...]) -> bool:
    linears = [getattr(module, name, None) for name in names]
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    first, *others = [linear for linear in linears if isinstance(linear, nn.Linear)]
    return all(
        linear.in_features == first.in_features
        and linear.weight.dtype == first.weight.dtype
        and linear.weight.device == first.weight.device
        and (linear.bias is None) == (first.bias is None)
        for linear in others
    )


def _share_storage(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) into one tensor each, and make each linear's parameters
    views of its rows there; returns the fused weight and bias."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        has_bias = linears[0].bias is not None
        bias = torch.cat([linear.bias for linear in linears if linear.bias is not None]) if has_bias else None
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        linear.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=False)
        start = rows.stop
    return weight, bias


def _fuse_mlp(mlp: nn.Module) -> None:
    """Point gate_proj's and up_proj's parameters at one fused tensor (a non-persistent buffer of the MLP,
    so a compiled MLP reads it as an input) and give the MLP a forward that multiplies by it once."""
    gate, up = mlp.gate_proj, mlp.up_proj
    weight, bias = _share_storage([gate, up])
    mlp.register_buffer("gate_up_weight", weight, persistent=False)
    mlp.register_buffer("gate_up_bias", bias, persistent=False)
    mlp.gate_up_sizes = [gate.out_features, up.out_features]
    mlp.forward = types.MethodType(_fused_mlp_forward, mlp)


def _fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).split(self.gate_up_sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)

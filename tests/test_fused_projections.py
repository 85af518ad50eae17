"""Fused projections (harness/server/fused_projections.py): the fused model computes what the unfused one
does, keeps its parameter names, takes weight updates in place, stays fused under torch.compile, and the
server fuses where it should. On CUDA the server fuses by default, so tests/test_server_gpu.py checks the
fused model's graphs and weight updates against a direct forward there."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch.nn import functional as F

from harness.compiled_blocks import compile_layers
from harness.server.fused_projections import ProjectionSlice, fuse_projections
from harness.testing import build_tiny_llama, build_tiny_qwen3, build_tiny_qwen3_5
from harness.weight_sync.wire import copy_into_model

BUILDERS = {"qwen3": build_tiny_qwen3, "llama": build_tiny_llama, "qwen3_5": build_tiny_qwen3_5}


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_a_fused_model_computes_the_unfused_logits_under_the_same_parameter_names(arch):
    reference, model = BUILDERS[arch](), BUILDERS[arch]()
    names = fuse_projections(model)
    attentions = [
        name for name, m in model.named_modules() if isinstance(getattr(m, "q_proj", None), ProjectionSlice)
    ]
    mlps = [name for name, m in model.named_modules() if hasattr(m, "gate_up_weight")]
    assert attentions and mlps and sorted(names) == sorted(attentions + mlps)
    if arch == "qwen3_5":  # its DeltaNet layers project otherwise: only the full-attention layers fuse
        assert len(attentions) < len(mlps)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    assert shapes == {name: tensor.shape for name, tensor in reference.state_dict().items()}
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    ids = torch.randint(5, 90, (3, 17))
    assert torch.equal(logits(model, ids), logits(reference, ids))


def test_a_weight_update_copied_into_the_parameters_reaches_the_fused_matmuls():
    model, updated = build_tiny_qwen3(), build_tiny_qwen3(seed=5)
    fuse_projections(model)
    ids = torch.randint(5, 90, (2, 11))
    assert not torch.equal(logits(model, ids), logits(updated, ids))
    assert copy_into_model(model, updated.state_dict().items()) == len(updated.state_dict())
    assert torch.equal(logits(model, ids), logits(updated, ids))


def test_a_projection_asked_out_of_turn_or_twice_computes_its_own_share():
    # The fused results are handed out for the input they were computed from, once each: any other call
    # multiplies by the projection's own rows, so a caller that does not ask q, k, v in turn stays correct.
    model = build_tiny_qwen3()
    attention = model.model.layers[0].self_attn
    weights = {p: getattr(attention, f"{p}_proj").weight.detach().clone() for p in "qkv"}
    fuse_projections(model)
    x, y = torch.randn(2, 5, attention.q_proj.in_features), torch.randn(4, attention.q_proj.in_features)
    with torch.no_grad():
        asked = [("q", x), ("k", y), ("v", x), ("k", x), ("k", x), ("q", x), ("q", y), ("v", y), ("v", y)]
        for p, inputs in asked:
            got = getattr(attention, f"{p}_proj")(inputs)
            assert torch.allclose(got, F.linear(inputs, weights[p]), atol=1e-6), (p, inputs.shape)


def test_compiled_layers_trace_one_matmul_for_q_k_v_and_one_for_gate_up():
    class CountingBackend:
        def __init__(self) -> None:
            self.linears: list[int] = []

        def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
            self.linears.append(sum("linear" in str(node.target) for node in graph_module.graph.nodes))
            return graph_module.forward

    import torch._dynamo

    ids = torch.randint(5, 90, (2, 9))
    counts, outputs = {}, {}
    try:
        for fused in (False, True):
            torch._dynamo.reset()
            model = build_tiny_qwen3(num_hidden_layers=2)
            if fused:
                fuse_projections(model)
            backend = CountingBackend()
            compile_layers(model, backend=backend)
            outputs[fused] = logits(model, ids)
            counts[fused] = backend.linears
    finally:
        torch._dynamo.reset()
    # q, k, v, o, gate, up, down apart; then q/k/v as one and gate/up as one, in the same graphs
    assert counts[False] and max(counts[False]) == 7
    assert len(counts[True]) == len(counts[False]) and max(counts[True]) == 4
    assert torch.equal(outputs[True], outputs[False])


@pytest.mark.parametrize(
    ("fuse", "enable_lora", "fused"), [(None, False, False), (True, False, True), (True, True, False)]
)
def test_the_server_fuses_when_asked_by_default_on_a_gpu_alone_and_never_with_lora(
    fuse, enable_lora, fused, caplog
):
    from engine_requests import run_requests

    from harness.server.sampling import SamplingParams
    from harness.server.state import ServerConfig, ServerState

    prompts = [[5, 6, 7, 8, 9], list(range(20, 41)), [3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, num_logprobs=2)
    config = ServerConfig(model="tiny", max_model_len=64, fuse_projections=fuse, enable_lora=enable_lora)
    reference = ServerConfig(model="tiny", max_model_len=64, fuse_projections=False)
    outputs = []
    with caplog.at_level(logging.WARNING, logger="harness.server.state"):
        for setting in (config, reference):
            state = ServerState.from_model(build_tiny_qwen3(), setting)
            try:
                if setting is config:
                    q_proj = state.model.model.layers[0].self_attn.q_proj
                    assert isinstance(q_proj, ProjectionSlice) is fused
                    assert hasattr(state.model.model.layers[0].mlp, "gate_up_weight") is fused
                outputs.append(run_requests(state.engine, prompts, params, together=True))
            finally:
                state.close()
    assert ("--enable-lora" in caplog.text) is (fuse is True and enable_lora)
    for got, expected in zip(*outputs, strict=True):
        assert got.output_ids == expected.output_ids
        assert got.logprobs == expected.logprobs
        assert got.top_logprobs == expected.top_logprobs


def test_the_serve_command_passes_fuse_projections_through():
    from harness.server.cli import _configure_parser

    parser = argparse.ArgumentParser()
    _configure_parser(parser)
    assert parser.parse_args(["m"]).fuse_projections is None
    assert parser.parse_args(["m", "--fuse-projections"]).fuse_projections is True
    assert parser.parse_args(["m", "--no-fuse-projections"]).fuse_projections is False

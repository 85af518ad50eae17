"""Compiled blocks (harness/compiled_blocks.py): which modules are compiled, one compilation for
every row length, and the same loss and gradients as the eager model. On CPU the graphs run through
AOTAutograd without code generation (backend "aot_eager" or a counting backend); the inductor path runs in
tests/test_gpu_training_core.py. The built-in server's choice of modules is checked here; its compiled forward
against a direct one in tests/test_server_gpu.py (compiled by default on a GPU)."""

from __future__ import annotations

import pytest
import torch

from harness.compiled_blocks import compilable_blocks, compilable_layers, compile_blocks, compile_layers
from harness.packing import pack_row
from harness.testing import build_tiny_qwen3, build_tiny_qwen3_5, build_tiny_qwen3_moe
from harness.training.attention import packed_forward, prepare_model_for_tree_attention
from harness.training.logprobs import row_logprobs
from harness.types import TrainingSample, TrainingSequence


def group(prompt_len: int, completion_len: int, num: int = 3) -> list[TrainingSample]:
    """`num` completions of `completion_len` tokens after one prompt of `prompt_len`."""
    prompt = [(7 * i) % 90 + 5 for i in range(prompt_len)]
    samples = []
    for j in range(num):
        ids = prompt + [(11 * i + j) % 90 + 5 for i in range(completion_len)]
        mask = [0] * prompt_len + [1] * completion_len
        sequence = TrainingSequence(ids, mask, [0.0] * len(ids), [None] * len(ids), [None] * len(ids))
        samples.append(TrainingSample(sequence=sequence, advantage=1.0, group_id=0))
    return samples


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Graphs cached by earlier tests (they outlive their models) would count against the recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given (and keeps the ops each calls) and runs
    them as traced."""

    def __init__(self) -> None:
        self.num_graphs = 0
        self.targets: list[set[str]] = []

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        self.num_graphs += 1
        self.targets.append(
            {str(node.target) for node in graph_module.graph.nodes if node.op != "placeholder"}
        )
        return graph_module.forward


def loss_and_grads(model: torch.nn.Module, samples: list[TrainingSample]) -> tuple[torch.Tensor, dict]:
    row = pack_row(samples)
    hidden = packed_forward(model, row)
    logprobs = row_logprobs(hidden, row, model.get_output_embeddings().weight, chunk_size=16).logprobs
    loss = (logprobs * torch.linspace(-1, 1, logprobs.numel())).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_norms_and_mlps_of_every_layer_are_found():
    model = build_tiny_qwen3(num_hidden_layers=2)
    names = [name for name, _ in compilable_blocks(model)]
    per_layer = ["self_attn.q_norm", "self_attn.k_norm", "mlp", "input_layernorm", "post_attention_layernorm"]
    expected = [f"model.layers.{i}.{part}" for i in range(2) for part in per_layer] + ["model.norm"]
    assert sorted(names) == sorted(expected)


def test_lora_wrapped_mlps_and_experts_stay_eager():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_tiny_qwen3(num_hidden_layers=2), LoraConfig(r=4, target_modules=["up_proj", "q_proj"])
    )
    names = [name for name, _ in compilable_blocks(model)]
    assert not [n for n in names if n.endswith("mlp")]  # its projections are LoRA layers
    assert len([n for n in names if n.endswith("layernorm")]) == 4
    moe = [name for name, _ in compilable_blocks(build_tiny_qwen3_moe())]
    assert not [n for n in moe if ".experts." in f"{n}."]
    assert not [n for n in moe if n.endswith("mlp")]  # a sparse block is no dense gated MLP


def test_gated_norms_of_deltanet_layers_stay_eager():
    model = build_tiny_qwen3_5()
    for name, module in compilable_blocks(model):
        assert "Gated" not in type(module).__name__, name
    assert any(name.endswith("input_layernorm") for name, _ in compilable_blocks(model))


def test_whole_decoder_layers_are_found_and_other_layers_keep_their_blocks():
    model = build_tiny_qwen3(num_hidden_layers=2)
    assert [name for name, _ in compilable_layers(model)] == ["model.layers.0", "model.layers.1"]
    names = compile_layers(model, backend=CountingBackend())
    assert names == ["model.layers.0", "model.layers.1", "model.norm"]  # the final norm sits outside them
    moe = build_tiny_qwen3_moe()
    assert not compilable_layers(moe)  # a sparse block is no dense MLP: its layers keep their norms alone
    assert compile_layers(moe, backend=CountingBackend()) == [name for name, _ in compilable_blocks(moe)]


def test_an_engine_of_whole_compiled_layers_decodes_as_the_eager_one():
    # The layers' graphs hold the rotary embedding and the residual adds, never the attention that reads and
    # writes the row cache (the graph breaks around it); as traced, they give the eager engine's tokens and
    # log-probs exactly, alone and together, prefill and decode.
    from engine_requests import run_requests

    from harness.server.engine import Engine
    from harness.server.sampling import SamplingParams

    prompts = [[9] * 40, [3, 4], list(range(20, 31))]
    params = SamplingParams(max_tokens=6, temperature=0.0, num_logprobs=3)
    backend = CountingBackend()
    outputs = []
    for compiled in (False, True):
        model = build_tiny_qwen3(num_hidden_layers=2)
        if compiled:
            compile_layers(model, backend=backend)
        engine = Engine(model, max_model_len=128, eos_token_ids=[], max_num_seqs=8, kv_cache_tokens=8 * 128)
        engine.start()
        try:
            outputs.append(
                run_requests(engine, prompts, params, together=True) + run_requests(engine, [[2]], params)
            )
        finally:
            engine.close()
    for eager, compiled in zip(*outputs, strict=True):
        assert compiled.output_ids == eager.output_ids
        assert compiled.logprobs == eager.logprobs
        assert compiled.top_logprobs == eager.top_logprobs
    traced = set().union(*backend.targets)
    assert any("cat" in target for target in traced), traced  # the rotary embedding's concatenation
    assert not [target for target in traced if "scaled_dot_product" in target or "index_put" in target]


def test_one_compilation_serves_every_row_length_with_the_same_results():
    eager = prepare_model_for_tree_attention(build_tiny_qwen3(num_hidden_layers=2))
    compiled = prepare_model_for_tree_attention(build_tiny_qwen3(num_hidden_layers=2))
    eager.train(), compiled.train()
    backend = CountingBackend()
    compile_blocks(compiled, backend=backend)
    graphs_after = []
    for prompt_len, completion_len in [(9, 4), (23, 7), (41, 13)]:
        samples = group(prompt_len, completion_len)
        expected_loss, expected_grads = loss_and_grads(eager, samples)
        loss, grads = loss_and_grads(compiled, samples)
        torch.testing.assert_close(loss, expected_loss, atol=0, rtol=0)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=0, rtol=0, msg=name)
        graphs_after.append(backend.num_graphs)
    # the q/k norms (head_dim wide), the hidden-size norms and the MLP: three graphs, then no more
    assert graphs_after == [3, 3, 3]


def test_through_aot_autograd_the_gradients_match_eager():
    eager = prepare_model_for_tree_attention(build_tiny_qwen3(num_hidden_layers=2))
    compiled = prepare_model_for_tree_attention(build_tiny_qwen3(num_hidden_layers=2))
    eager.train(), compiled.train()
    compile_blocks(compiled, backend="aot_eager")
    for prompt_len, completion_len in [(9, 4), (30, 10)]:
        samples = group(prompt_len, completion_len)
        expected_loss, expected_grads = loss_and_grads(eager, samples)
        loss, grads = loss_and_grads(compiled, samples)
        torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("value", "compiled"), [(None, False), (True, True), (False, False)])
def test_the_trainer_compiles_the_policy_when_asked_and_by_default_only_on_cuda(tmp_path, value, compiled):
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.testing import build_tiny_tokenizer

    model = build_tiny_qwen3(num_hidden_layers=2)
    settings = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, compile_blocks=value)
    AsyncGRPOTrainer(  # construction only: modules compile at their first call
        model,
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=AsyncGRPOConfig(**settings),
        train_dataset=[{"prompt": [{"role": "user", "content": "hi"}]}],
        processing_class=build_tiny_tokenizer(),
    )
    blocks = compilable_blocks(model)
    assert len(blocks) == 11
    assert all((module._compiled_call_impl is not None) is compiled for _, module in blocks)


def test_compiling_raises_the_recompile_limit_for_the_shared_code():
    import torch._dynamo

    from harness.compiled_blocks import RECOMPILE_LIMIT

    previous = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        compile_blocks(build_tiny_qwen3(num_hidden_layers=1), backend=CountingBackend())
        assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT
    finally:
        torch._dynamo.config.recompile_limit = previous


def test_torch_compile_is_refused_with_the_alternative():
    from harness.config import AsyncGRPOConfig

    with pytest.raises(ValueError, match=r"torch_compile=True is not supported.*compile_blocks"):
        AsyncGRPOConfig(output_dir="/tmp/unused", torch_compile=True, report_to="none")


@pytest.mark.parametrize(
    ("value", "enable_lora", "norms", "mlps"),
    [
        (None, False, False, False),
        (True, False, True, True),
        (True, True, True, False),
        (False, True, False, False),
    ],
)
def test_the_server_compiles_its_blocks_when_asked_and_keeps_lora_mlps_eager(value, enable_lora, norms, mlps):
    # None is "on a GPU unless enforce_eager": off here, on CPU. With LoRA the adapters' hooks go on the MLPs'
    # projections after the compile, so those MLPs stay eager; the norms are never adapted.
    from harness.server.state import ServerConfig, ServerState

    model = build_tiny_qwen3(num_hidden_layers=2)
    config = ServerConfig(model="tiny", max_model_len=64, compile_blocks=value, enable_lora=enable_lora)
    state = ServerState.from_model(model, config)  # modules compile at their first call
    try:
        for name, module in compilable_blocks(model):
            expected = norms if name.endswith("norm") else mlps
            assert (module._compiled_call_impl is not None) is expected, name
    finally:
        state.close()


@pytest.mark.parametrize("enable_lora", [False, True])
def test_the_server_compiles_whole_layers_when_asked_and_only_norms_with_lora(enable_lora, monkeypatch):
    import functools

    from harness import compiled_blocks
    from harness.server.state import ServerConfig, ServerState

    for name in ("compile_blocks", "compile_layers"):  # traced, not compiled by inductor: seconds on CPU
        monkeypatch.setattr(
            compiled_blocks, name, functools.partial(getattr(compiled_blocks, name), backend="eager")
        )
    model = build_tiny_qwen3(num_hidden_layers=2)
    config = ServerConfig(model="tiny", max_model_len=64, compile_layers=True, enable_lora=enable_lora)
    state = ServerState.from_model(model, config)
    try:
        for _, layer in compilable_layers(model):
            assert (layer._compiled_call_impl is not None) is not enable_lora
        assert model.model.norm._compiled_call_impl is not None
        assert (model.model.layers[0].input_layernorm._compiled_call_impl is not None) is enable_lora
    finally:
        state.close()


def test_the_serve_command_passes_compile_blocks_through():
    import argparse

    from harness.server.cli import _configure_parser

    parser = argparse.ArgumentParser()
    _configure_parser(parser)
    assert parser.parse_args(["m"]).compile_blocks is None
    assert parser.parse_args(["m", "--compile-blocks"]).compile_blocks is True
    assert parser.parse_args(["m", "--no-compile-blocks"]).compile_blocks is False
    assert parser.parse_args(["m"]).compile_layers is False
    assert parser.parse_args(["m", "--compile-layers"]).compile_layers is True


@pytest.mark.parametrize(
    ("warm_up", "compile_fn", "fused"),
    [
        (True, compile_blocks, False),
        (False, compile_blocks, False),
        (True, compile_layers, False),
        (True, compile_blocks, True),
        (True, compile_layers, True),
    ],
)
def test_the_engines_warm_up_compiles_every_shape_its_requests_take(warm_up, compile_fn, fused):
    # Dynamic shapes specialise sizes of 1: one row and several, one new token (decode) and several (prefill).
    # After the warm-up, requests alone and together, short and long, compile nothing more; without it the
    # first requests do the compiling (the mutation check: the same requests then add graphs). So too with
    # the server's fused projections (their q and k reach the norms as strided views of one output).
    from engine_requests import run_requests

    from harness.server.engine import Engine
    from harness.server.fused_projections import fuse_projections
    from harness.server.sampling import SamplingParams

    model = build_tiny_qwen3(num_hidden_layers=2)
    if fused:
        fuse_projections(model)
    backend = CountingBackend()
    compile_fn(model, backend=backend)
    engine = Engine(model, max_model_len=128, eos_token_ids=[], max_num_seqs=8, kv_cache_tokens=8 * 128)
    if warm_up:
        assert engine.warm_up() > 0 and engine.cache.allocated_tokens == 0
    warmed = backend.num_graphs
    engine.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        run_requests(engine, [[5, 6, 7]], params)
        run_requests(engine, [[9] * 40, [3, 4], [8] * 11], params, together=True)
        run_requests(engine, [[2]], params)
    finally:
        engine.close()
    assert (backend.num_graphs == warmed) is warm_up, (warmed, backend.num_graphs)


@pytest.mark.parametrize(
    ("setting", "advice"),
    [("compile_blocks", "with --no-compile-blocks"), ("compile_layers", "without --compile-layers")],
)
def test_a_compile_that_fails_in_the_warm_up_names_the_flag_that_avoids_it(monkeypatch, setting, advice):
    from harness.server.engine import Engine
    from harness.server.state import ServerConfig, ServerState

    def fail(self):
        raise RuntimeError("inductor could not compile")

    monkeypatch.setattr(Engine, "warm_up", fail)
    with pytest.raises(RuntimeError, match=f"serve {advice} "):
        ServerState.from_model(build_tiny_qwen3(), ServerConfig(model="tiny", **{setting: True}))


@pytest.mark.slow
@pytest.mark.parametrize("what", ["compile_blocks", "compile_layers"])
def test_a_server_compiled_with_inductor_answers_as_the_eager_one(what):
    # The real compiler on CPU (the GPU test runs it on CUDA): the warm-up compiles, then greedy tokens and
    # their log-probs equal those of the same model served eagerly.
    from engine_requests import run_requests

    from harness.server.sampling import SamplingParams
    from harness.server.state import ServerConfig, ServerState

    prompts = [[5, 6, 7, 8, 9], list(range(20, 61)), [3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, num_logprobs=0)
    outputs = {}
    for compiled in (False, True):
        config = ServerConfig(model="tiny", max_model_len=128, **{what: compiled})
        state = ServerState.from_model(build_tiny_qwen3(), config)
        try:
            outputs[compiled] = run_requests(state.engine, prompts, params)
        finally:
            state.close()
    for eager, compiled in zip(outputs[False], outputs[True], strict=True):
        assert compiled.output_ids == eager.output_ids
        assert compiled.logprobs == pytest.approx(eager.logprobs, abs=1e-5)

"""Tree attention: a packed row's per-token log-probs equal each sample's own forward (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from harness.packing import pack_row
from harness.testing import build_tiny_llama, build_tiny_qwen3, build_tiny_qwen3_5, build_tiny_qwen3_moe
from harness.training.attention import (
    TreeAttentionError,
    TreeMask,
    gated_delta_rule_chunked,
    packed_forward,
    prepare_model_for_tree_attention,
)
from harness.training.logprobs import row_logprobs
from harness.types import TrainingSample, TrainingSequence


def sample(prompt: list[int], completion: list[int], *, group: int = 0) -> TrainingSample:
    ids = prompt + completion
    mask = [0] * len(prompt) + [1] * len(completion)
    sequence = TrainingSequence(ids, mask, [0.0] * len(ids), [None] * len(ids), [None] * len(ids))
    return TrainingSample(sequence=sequence, advantage=1.0, group_id=group)


# Two groups sharing a system prompt [5 6 7 8]; group 0 has three rollouts, one of which forked after its
# first turn (the second turn re-rendered 40 41 as 40 42), and a duplicate rollout; group 1 one rollout.
SYSTEM = [5, 6, 7, 8]
ROWS = [
    sample([*SYSTEM, 100, 101, 102], [20, 21, 22, 23]),
    sample([*SYSTEM, 100, 101, 102], [30, 31]),
    sample([*SYSTEM, 100, 101, 102, 30, 31, 40, 41], [50, 51, 52, 53, 54]),  # second turn of rollout 1
    sample([*SYSTEM, 100, 101, 102, 30, 31, 40, 42], [60, 61]),  # its fork: re-rendered history
    sample([*SYSTEM, 100, 101, 102], [20, 21, 22, 23]),  # a duplicate rollout
    sample([*SYSTEM, 200, 201], [70, 71, 72], group=1),
    sample([9, 9], [80]),  # a two-token prompt: shorter than the DeltaNet convolution
]


def unpacked_logprobs(model: torch.nn.Module, samples: list[TrainingSample]) -> torch.Tensor:
    """Each sample forwarded on its own with the stock attention, log-probs at its trained tokens."""
    values = []
    for s in samples:
        ids = torch.tensor(s.sequence.input_ids)
        logprobs = model(ids[None]).logits[0].float().log_softmax(-1)
        positions = torch.tensor([t for t, m in enumerate(s.sequence.loss_mask) if m])
        values.append(logprobs[positions - 1, ids[positions]])
    return torch.cat(values)


def packed_logprobs(model: torch.nn.Module, samples: list[TrainingSample]) -> torch.Tensor:
    row = pack_row(samples)
    hidden = packed_forward(model, row)
    return row_logprobs(hidden, row, model.get_output_embeddings().weight, chunk_size=5).logprobs


def check_exact(build, **overrides) -> None:
    reference = build(**overrides)
    packed = prepare_model_for_tree_attention(build(**overrides))
    with torch.no_grad():
        expected = unpacked_logprobs(reference, ROWS)
        got = packed_logprobs(packed, ROWS)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_mask_of_the_spec_example():
    a, b = sample([11, 12, 13], [21, 22]), sample([11, 12, 13], [31, 32])
    mask = TreeMask.from_row(pack_row([a, b])).dense_mask()
    expected = torch.tensor(
        [
            # p1 p2 p3 a1 a2 b1 b2   (keys)
            [1, 0, 0, 0, 0, 0, 0],  # p1
            [1, 1, 0, 0, 0, 0, 0],  # p2
            [1, 1, 1, 0, 0, 0, 0],  # p3
            [1, 1, 1, 1, 0, 0, 0],  # a1
            [1, 1, 1, 1, 1, 0, 0],  # a2
            [1, 1, 1, 0, 0, 1, 0],  # b1
            [1, 1, 1, 0, 0, 1, 1],  # b2
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    # a window of 2 in depth: b2 (depth 4) sees b1 (3) and itself, not p3 (2)
    assert TreeMask.from_row(pack_row([a, b])).dense_mask(sliding_window=2)[6].tolist() == [
        0,
        0,
        0,
        0,
        0,
        1,
        1,
    ]


def test_the_example_row_shares_tokens():
    row = pack_row(ROWS)
    assert row.num_tokens == 31 and sum(row.sample_lengths) == 72


def test_qwen3_packed_equals_unpacked():
    check_exact(build_tiny_qwen3)


def test_llama_packed_equals_unpacked():
    check_exact(build_tiny_llama)


def test_qwen3_moe_packed_equals_unpacked():
    check_exact(build_tiny_qwen3_moe)


def test_qwen3_sliding_window_layers_are_respected():
    window = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}
    check_exact(build_tiny_qwen3, **window)
    # the window changes the answer, so the check above could fail
    with torch.no_grad():
        windowed = unpacked_logprobs(build_tiny_qwen3(**window), ROWS)
        full = unpacked_logprobs(build_tiny_qwen3(), ROWS)
    assert (windowed - full).abs().max() > 1e-3


def test_qwen3_5_gated_deltanet_hybrid_packed_equals_unpacked():
    check_exact(build_tiny_qwen3_5)


def test_qwen3_5_with_a_stock_deltanet_layer_would_be_wrong():
    # The stock layer ignores the tree (it runs its recurrence straight along the row), which is why
    # preparation wraps it: unwrapped, packed log-probs differ from the unpacked ones.
    model = prepare_model_for_tree_attention(build_tiny_qwen3_5())
    for module in model.modules():
        if getattr(module, "_harness_tree_ready", False):
            del module.forward
    with torch.no_grad():
        got = packed_logprobs(model, ROWS)
        expected = unpacked_logprobs(build_tiny_qwen3_5(), ROWS)
    assert (got - expected).abs().max() > 1e-3


def test_packed_gradients_equal_the_sum_of_unpacked_gradients():
    reference, packed = build_tiny_qwen3(), prepare_model_for_tree_attention(build_tiny_qwen3())
    weights = torch.linspace(-1.0, 1.0, sum(s.sequence.num_trained for s in ROWS))
    (unpacked_logprobs(reference, ROWS) * weights).sum().backward()
    (packed_logprobs(packed, ROWS) * weights).sum().backward()
    for (name, expected), got in zip(reference.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=2e-5, rtol=1e-4, msg=name)


def naive_gated_delta_rule(q, k, v, g, beta, state):
    """The recurrence step by step ([B, H, L, *] inputs): the definition the chunked form must equal."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        update = beta[:, :, t, None] * (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2))
        state = state + k[:, :, t, :, None] * update[..., None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, dim=2), state


def test_chunked_gated_delta_rule_equals_the_recurrence_from_a_given_state():
    generator = torch.Generator().manual_seed(0)
    b, h, length, dk, dv = 2, 3, 37, 8, 5

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(normal(b, h, length, dk), dim=-1) for _ in range(2))
    v, state = normal(b, h, length, dv), normal(b, h, dk, dv)
    g = -torch.rand(b, h, length, generator=generator, dtype=torch.float64)
    beta = torch.rand(b, h, length, generator=generator, dtype=torch.float64)
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=8)
    expected_out, expected_final = naive_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, expected_final, atol=1e-10, rtol=1e-10)


def test_unsupported_recurrent_layers_are_rejected_at_preparation():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    with pytest.raises(TreeAttentionError, match=r"Qwen3NextGatedDeltaNet.*Qwen3\.5-style"):
        prepare_model_for_tree_attention(Qwen3NextForCausalLM(config))


def test_soft_capping_is_rejected():
    model = build_tiny_qwen3()
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(TreeAttentionError, match="attn_logit_softcapping"):
        prepare_model_for_tree_attention(model)


def test_calls_without_a_tree_are_refused():
    model = build_tiny_qwen3()
    with pytest.raises(TreeAttentionError, match="prepare_model_for_tree_attention"):
        packed_forward(model, pack_row(ROWS[:1]))
    prepare_model_for_tree_attention(model)
    with pytest.raises(TreeAttentionError, match="without a tree_mask"):
        model(torch.tensor([[1, 2, 3]]))


# --- the varlen backend: segments as variable-length sequences -------------------------------------------


def test_the_varlen_plan_gathers_each_segments_path():
    """The spec example: the prompt, then each completion with the prompt's keys gathered before its own."""
    a, b = sample([11, 12, 13], [21, 22]), sample([11, 12, 13], [31, 32])
    plan = TreeMask.from_row(pack_row([a, b])).varlen_plan()
    assert plan.cu_q.tolist() == [0, 3, 5, 7]
    assert plan.cu_k.tolist() == [0, 3, 8, 13]
    assert plan.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6]
    assert (plan.max_q, plan.max_k) == (3, 5)


def test_the_varlen_plan_equals_the_dense_mask_on_a_forked_row():
    """Every segment's gathered keys, with bottom-right causal alignment, are exactly the dense mask's row."""
    tree = TreeMask.from_row(pack_row(ROWS))
    plan, dense = tree.varlen_plan(), tree.dense_mask()
    cu_q, cu_k = plan.cu_q.tolist(), plan.cu_k.tolist()
    for s in range(len(cu_q) - 1):
        keys = plan.key_index[cu_k[s] : cu_k[s + 1]]
        for i, query in enumerate(range(cu_q[s], cu_q[s + 1])):
            visible = keys[: len(keys) - (cu_q[s + 1] - cu_q[s]) + i + 1]
            assert sorted(visible.tolist()) == dense[query].nonzero().squeeze(-1).tolist()


def test_the_cascade_plan_of_a_group_is_completions_against_themselves_then_against_the_prompt():
    """One prompt, two completions: a causal self part over the segments, and one dense rectangle (both
    completions against the prompt) whose covered rows are a slice, so nothing is gathered."""
    a, b = sample([11, 12, 13], [21, 22]), sample([11, 12, 13], [31, 32])
    self_part, cross = TreeMask.from_row(pack_row([a, b])).cascade_plan().parts
    assert (self_part.cu_q.tolist(), self_part.cu_k.tolist(), self_part.causal) == (
        [0, 3, 5, 7],
        [0, 3, 5, 7],
        True,
    )
    # sequences: rows 0-2 have no keys here; completions 3-6 against keys 0-2; keys 3-6 have no queries
    assert (cross.cu_q.tolist(), cross.cu_k.tolist(), cross.causal) == ([0, 3, 7, 7], [0, 0, 3, 7], False)
    assert cross.rows == slice(3, 7) and (cross.max_q, cross.max_k) == (4, 4)


def test_the_cascade_covers_exactly_the_dense_mask_on_a_forked_row():
    """Over all parts, each query sees each key of its path exactly once (and nothing else)."""
    tree = TreeMask.from_row(pack_row(ROWS))
    dense, count = tree.dense_mask(), torch.zeros(tree.num_tokens, tree.num_tokens, dtype=torch.int64)
    for part in tree.cascade_plan().parts:
        cu_q, cu_k = part.cu_q.tolist(), part.cu_k.tolist()
        for j in range(len(cu_q) - 1):
            for i, query in enumerate(range(cu_q[j], cu_q[j + 1])):
                keys = range(cu_k[j], cu_k[j + 1])
                if part.causal:  # bottom-right aligned
                    keys = keys[: len(keys) - (cu_q[j + 1] - cu_q[j]) + i + 1]
                count[query, list(keys)] += 1
    assert torch.equal(count, dense.long())
    # self, then one per level with descendants: system prompt, shared turn, [30 31], the forked [40]
    assert len(tree.cascade_plan().parts) == 1 + 4


@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_cascade_attention_and_its_backward_equal_the_dense_mask(heads_kv):
    """The merged forward and the backward by merged output and log-sum-exp give the dense-mask attention's
    output and gradients (the parts compute in float32, as FlashAttention accumulates)."""
    from harness.training.tree_cascade import cascade_attention

    tree = TreeMask.from_row(pack_row(ROWS))
    generator = torch.Generator().manual_seed(0)
    t = tree.num_tokens
    q, k, v = (
        torch.randn(t, h, 8, generator=generator, dtype=torch.float64) for h in (4, heads_kv, heads_kv)
    )
    d_out = torch.randn(t, 4, 8, generator=generator)

    def dense(q, k, v):
        mask = tree.dense_mask()[None]
        repeat = 4 // heads_kv
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(repeat, 1).transpose(0, 1),
            v.repeat_interleave(repeat, 1).transpose(0, 1),
            attn_mask=mask,
            scale=0.3,
        ).transpose(0, 1)

    results = []
    for attend in (dense, lambda q, k, v: cascade_attention(q, k, v, tree.cascade_plan(), scale=0.3)):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend(*inputs)
        out.backward(d_out)
        results.append((out.detach(), *(x.grad for x in inputs)))
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("build", "overrides", "backend"),
    [
        (build_tiny_qwen3, {}, "varlen"),
        (build_tiny_qwen3, {}, "varlen_gather"),
        (build_tiny_llama, {}, "varlen"),
        (
            build_tiny_qwen3,
            {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
            "varlen",
        ),
        (build_tiny_qwen3_5, {}, "varlen"),
    ],
    ids=["qwen3", "qwen3-gather", "llama", "qwen3-sliding-window", "qwen3.5-hybrid"],
)
def test_varlen_backend_packed_equals_unpacked(build, overrides, backend):
    """On CPU the varlen parts run in plain arithmetic (the cascade; the gathered layout through SDPA): the
    same exactness as the dense mask."""
    reference = build(**overrides)
    packed = prepare_model_for_tree_attention(build(**overrides))
    with torch.no_grad():
        expected = unpacked_logprobs(reference, ROWS)
        row = pack_row(ROWS)
        hidden = packed_forward(packed, row, backend=backend)
        got = row_logprobs(hidden, row, packed.get_output_embeddings().weight, chunk_size=5).logprobs
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

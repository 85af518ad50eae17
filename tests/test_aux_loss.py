"""The load-balancing loss of a Mixture-of-Experts policy (`aux_loss`), on a tiny Qwen3-MoE (CPU, float32).

The trainer's real `_train_on_plan` runs on fixed rows, without a server or a worker. The references are
transformers' own: `load_balancing_loss_func` over the router logits of a plain forward of each sample. A
step with `router_aux_loss_coef = c` must log the rows' mean aux loss, unscaled, and its gradient must
exceed the step's gradient at c = 0 by exactly c times the mean over rows of the aux loss's gradient,
however the rows are spread over micro-batches. Dense models and c = 0 log nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from harness.packing import pack_row
from harness.testing import build_tiny_qwen3, build_tiny_qwen3_moe
from harness.training.attention import TreeAttentionError, packed_forward, prepare_model_for_tree_attention
from harness.types import TrainingSample, TrainingSequence

NUM_EXPERTS, TOP_K = 4, 2  # tiny_qwen3_moe_config
COEF = 0.5  # large, so the aux loss's share of the gradient stands well above float32 rounding


def sample(
    prompt: list[int], completion: list[int], advantage: float = 1.0, group: int = 0
) -> TrainingSample:
    ids = prompt + completion
    mask = [0] * len(prompt) + [1] * len(completion)
    # near a random model's log-probs (about -log(vocab)), so the importance ratios stay in range
    old = [0.0] * len(prompt) + [-7.3] * len(completion)
    sequence = TrainingSequence(ids, mask, old, [None] * len(ids), [None] * len(ids))
    return TrainingSample(sequence, advantage, group)


A = sample([11, 12, 13, 14, 15, 16], [210, 211, 212, 213, 214], advantage=1.0, group=0)
B = sample([31, 32, 33, 34], [320, 321, 322], advantage=-0.5, group=1)


def make_trainer(tmp_path, model: Any, **overrides: Any) -> Any:
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.testing import build_tiny_tokenizer

    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        gradient_checkpointing=False,
        optim="sgd",
        learning_rate=0.1,
        max_grad_norm=0.0,  # no clipping: the optimizer sees the raw gradient
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(overrides)
    trainer = AsyncGRPOTrainer(
        model,
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=AsyncGRPOConfig(**settings),
        train_dataset=[{"prompt": [{"role": "user", "content": "hi"}]}],
        processing_class=build_tiny_tokenizer(),
    )
    trainer._setup_run(None)
    return trainer


def train_step(trainer: Any, micro_batches: list[list[list[TrainingSample]]]) -> tuple[dict, dict]:
    """One `_train_on_plan` over the rows: its metrics, and every parameter's gradient at the optimizer."""
    named = list(trainer.model.named_parameters())
    gradients: dict[str, torch.Tensor] = {}

    def keep(optimizer: Any, args: Any, kwargs: Any) -> None:
        for name, parameter in named:
            grad = parameter.grad
            gradients[name] = torch.zeros_like(parameter) if grad is None else grad.detach().clone()

    handle = trainer.optimizer.register_step_pre_hook(keep)
    try:
        metrics = trainer._train_on_plan({"micro_batches": micro_batches})
    finally:
        handle.remove()
    return metrics, gradients


def plain_aux_loss(s: TrainingSample) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' load-balancing loss of the sample forwarded alone (stock attention), and its gradient."""
    model = build_tiny_qwen3_moe()  # the same seed: the weights the trainer starts from
    outputs = model(input_ids=torch.tensor([s.sequence.input_ids]), output_router_logits=True)
    aux = load_balancing_loss_func(outputs.router_logits, NUM_EXPERTS, TOP_K)
    aux.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    return aux.item(), grads


def test_tree_attention_gives_the_router_logits_of_each_sample_forwarded_alone():
    """Two samples sharing a prompt, packed as p1..p6 a1..a5 b1..b3: each token's router logits are those
    of its own sample's plain forward."""
    b = sample(A.sequence.input_ids[:6], [330, 331, 332])
    reference = build_tiny_qwen3_moe()
    model = prepare_model_for_tree_attention(build_tiny_qwen3_moe())
    with torch.no_grad():
        hidden_T_H, router_logits_L = packed_forward(model, pack_row([A, b]), output_router_logits=True)
        plain_a = reference(input_ids=torch.tensor([A.sequence.input_ids]), output_router_logits=True)
        plain_b = reference(input_ids=torch.tensor([b.sequence.input_ids]), output_router_logits=True)
    assert hidden_T_H.shape == (14, 64)
    assert len(router_logits_L) == 2 and all(logits.shape == (14, NUM_EXPERTS) for logits in router_logits_L)
    for layer, logits in enumerate(router_logits_L):
        expected = torch.cat([plain_a.router_logits[layer], plain_b.router_logits[layer][6:]])
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    # the common case keeps its plain return
    assert torch.equal(packed_forward(model, pack_row([A, b])), hidden_T_H)


def test_asking_a_dense_model_for_router_logits_raises():
    model = prepare_model_for_tree_attention(build_tiny_qwen3())
    with pytest.raises(TreeAttentionError, match="Mixture-of-Experts"):
        packed_forward(model, pack_row([A]), output_router_logits=True)


def test_aux_loss_is_logged_unscaled_and_equals_transformers_on_a_plain_forward(tmp_path):
    expected, _ = plain_aux_loss(A)
    with_aux, _ = train_step(
        make_trainer(tmp_path, build_tiny_qwen3_moe(), router_aux_loss_coef=COEF), [[[A]]]
    )
    without, _ = train_step(make_trainer(tmp_path, build_tiny_qwen3_moe(), router_aux_loss_coef=0.0), [[[A]]])
    assert with_aux["aux_loss"] == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(TOP_K)  # not the value of an even load: the rows route unevenly
    # the step's loss includes the scaled aux loss
    assert with_aux["loss"] - without["loss"] == pytest.approx(COEF * expected, rel=1e-4)


@pytest.mark.parametrize(
    "micro_batches",
    [[[[A], [B]]], [[[A]], [[B]]]],
    ids=["one-micro-batch-of-two-rows", "two-micro-batches-of-one-row"],
)
def test_the_aux_gradient_is_coef_times_the_mean_over_rows(tmp_path, micro_batches):
    (aux_a, grad_a), (aux_b, grad_b) = plain_aux_loss(A), plain_aux_loss(B)
    with_aux, grads = train_step(
        make_trainer(tmp_path, build_tiny_qwen3_moe(), router_aux_loss_coef=COEF), micro_batches
    )
    without, grads_0 = train_step(
        make_trainer(tmp_path, build_tiny_qwen3_moe(), router_aux_loss_coef=0.0), micro_batches
    )
    assert with_aux["aux_loss"] == pytest.approx((aux_a + aux_b) / 2, rel=1e-5)
    assert "aux_loss" not in without
    assert with_aux["loss"] - without["loss"] == pytest.approx(COEF * (aux_a + aux_b) / 2, rel=1e-4)
    routers = [name for name in grads if name.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    for name in grads:
        expected = COEF * (grad_a[name] + grad_b[name]) / 2
        torch.testing.assert_close(grads[name] - grads_0[name], expected, atol=1e-6, rtol=1e-4)
    for name in routers:  # the routers' share of the aux gradient is not lost in the rounding
        assert (COEF * (grad_a[name] + grad_b[name]) / 2).abs().max() > 1e-3


def test_gradient_checkpointing_gives_the_same_aux_loss_and_gradient(tmp_path):
    plain, grads = train_step(
        make_trainer(tmp_path, build_tiny_qwen3_moe(), router_aux_loss_coef=COEF), [[[A], [B]]]
    )
    checkpointed, grads_checkpointed = train_step(
        make_trainer(
            tmp_path, build_tiny_qwen3_moe(), router_aux_loss_coef=COEF, gradient_checkpointing=True
        ),
        [[[A], [B]]],
    )
    assert checkpointed["aux_loss"] == pytest.approx(plain["aux_loss"], rel=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_checkpointed[name], grads[name], atol=1e-6, rtol=1e-5)


def test_the_coefficient_defaults_to_the_model_configs(tmp_path):
    trainer = make_trainer(tmp_path, build_tiny_qwen3_moe(router_aux_loss_coef=0.25))
    assert trainer.router_aux_loss_coef == 0.25
    metrics, _ = train_step(trainer, [[[A]]])
    assert metrics["aux_loss"] == pytest.approx(plain_aux_loss(A)[0], rel=1e-5)


def test_no_aux_loss_with_a_zero_coefficient(tmp_path):
    metrics, _ = train_step(make_trainer(tmp_path, build_tiny_qwen3_moe(router_aux_loss_coef=0.0)), [[[A]]])
    assert "aux_loss" not in metrics and "loss" in metrics


def test_a_dense_model_logs_no_aux_loss_and_refuses_a_coefficient(tmp_path):
    trainer = make_trainer(tmp_path, build_tiny_qwen3())
    assert trainer.router_aux_loss_coef == 0.0
    metrics, _ = train_step(trainer, [[[A]]])
    assert "aux_loss" not in metrics and "loss" in metrics
    with pytest.raises(ValueError, match="is set but the model is not a Mixture-of-Experts model"):
        make_trainer(tmp_path, build_tiny_qwen3(), router_aux_loss_coef=0.1)

"""Vision-language checkpoints (the reference's Qwen3.5) train on text: loaded as the image-text model
class, the vision tower frozen (no gradients, no optimizer state, no LoRA, not sent by weight sync), the
text model tree-packed exactly. Tiny random Qwen3.5 vision-language models built offline."""

from __future__ import annotations

import math

import pytest
import torch

from harness.model_loading import freeze_outside_text_model, load_model, outside_text_modules
from harness.packing import pack_row
from harness.testing import build_tiny_qwen3_5_vl, build_tiny_tokenizer
from harness.training.attention import packed_forward, prepare_model_for_tree_attention
from harness.training.logprobs import row_logprobs
from harness.types import TrainingSample, TrainingSequence
from harness.weight_sync.peft import served_parameters

FULL_ATTENTION = {"layer_types": ["full_attention"] * 4}  # a text model the built-in server can serve


def sample(prompt: list[int], completion: list[int]) -> TrainingSample:
    ids = prompt + completion
    n = len(ids)
    sequence = TrainingSequence(
        ids, [0] * len(prompt) + [1] * len(completion), [0.0] * n, [None] * n, [None] * n
    )
    return TrainingSample(sequence=sequence, advantage=1.0, group_id=0)


@pytest.fixture
def vl_dir(tmp_path):
    directory = tmp_path / "qwen3.5-vl"
    build_tiny_qwen3_5_vl().save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def test_a_vision_language_checkpoint_loads_as_one_with_its_tower_frozen(vl_dir):
    model = load_model(vl_dir)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    frozen = freeze_outside_text_model(model)
    assert frozen and all(name.startswith("model.visual.") for name in frozen)
    assert outside_text_modules(model) == ["model.visual"]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.language_model.", "lm_head.")) for n in trainable)
    served = [name for name, _ in served_parameters(model)]
    assert served and not any("visual" in name for name in served)
    assert set(served) == trainable  # the checkpoint's names: what vLLM loads


def test_the_text_model_of_a_vision_language_model_packs_exactly():
    samples = [sample([5, 6, 7, 8, 9], [20, 21, 22]), sample([5, 6, 7, 8, 9], [30, 31]), sample([9, 9], [40])]
    reference = build_tiny_qwen3_5_vl()
    model = prepare_model_for_tree_attention(build_tiny_qwen3_5_vl())
    with torch.no_grad():
        expected = []
        for s in samples:
            ids = torch.tensor(s.sequence.input_ids)
            logprobs = reference(input_ids=ids[None]).logits[0].float().log_softmax(-1)
            positions = torch.tensor([t for t, m in enumerate(s.sequence.loss_mask) if m])
            expected.append(logprobs[positions - 1, ids[positions]])
        row = pack_row(samples)
        got = row_logprobs(packed_forward(model, row), row, model.get_output_embeddings().weight).logprobs
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=0)


def length_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer_on_a_vision_language_checkpoint_trains_only_the_text_model(tmp_path, lora):
    """Two steps with the built-in server (which loads the checkpoint the same way): the text model's weights
    move, the tower's do not, the tower has no optimizer state and (with LoRA) no adapters, and the sync
    reached the server, whose text weights are the trainer's."""
    from datasets import Dataset
    from peft import LoraConfig

    from harness import AsyncGRPOConfig, AsyncGRPOTrainer

    directory = tmp_path / "model"
    build_tiny_qwen3_5_vl(**FULL_ATTENTION).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    before = {name: p.detach().clone() for name, p in load_model(str(directory)).named_parameters()}
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        max_staleness=0,
        num_generations=4,
        max_completion_length=8,
        max_concurrent_rollouts=8,
        gradient_checkpointing=False,
        learning_rate=1e-2 if lora else 1e-3,
        token_budget=400,
        save_strategy="no",
        report_to="none",
        generation_server="builtin",
        disable_tqdm=True,
    )
    prompts = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(16)]}
    )
    trainer = AsyncGRPOTrainer(
        str(directory),
        reward_funcs=length_reward,
        args=args,
        train_dataset=prompts,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None,
    )
    output = trainer.train()
    assert output.global_step == 2 and math.isfinite(output.training_loss)
    names = dict(trainer.model.named_parameters())
    assert not any("visual" in name and "lora_" in name for name in names)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    tower = [p for name, p in names.items() if "visual" in name]
    assert tower and not any(id(p) in optimized for p in tower)
    merged = dict(trainer_served(trainer.model))
    moved = [name for name in merged if not torch.equal(merged[name].cpu(), before[name])]
    assert moved and not any("visual" in name for name in moved)
    for name, value in before.items():
        if "visual" in name:
            current = next(p for n, p in names.items() if n.endswith(name.removeprefix("model.")))
            assert torch.equal(current.detach().cpu(), value), name
    sampling = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in e]
    # at zero staleness the server generated with the synced weights: its log-probs are the trainer's
    assert sampling and all(e["sampling/sampling_logp_difference/mean"] < 1e-4 for e in sampling)


def trainer_served(model):
    from harness.weight_sync.peft import merged_named_parameters

    return merged_named_parameters(model)

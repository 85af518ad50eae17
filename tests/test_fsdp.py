"""FSDP2 on CPU: two gloo processes train like one process does.

The trainer's real step runs in both set-ups on the same fixed samples (no rollout worker, no generation
server): rank 0 plans the rows and broadcasts them (`_plan_step` and `_broadcast` inside `_train_step`), each
rank forwards its row through the FSDP2-sharded tiny Qwen3 (harness/training/fsdp.py), the gradients are
reduced by FSDP2, the optimizer steps, and the weight sync gathers the full parameters in buckets to rank 0,
which writes them into the transfer file a fake server reads. Two steps (the second with its gradient norm
clipped): the loss, the updated weights and the gathered weights must equal one process's. Variants: tied
embeddings with gradient checkpointing, LoRA (merged sync), bf16 mixed precision, compiled norms and MLPs
(compile_blocks, through AOTAutograd), a checkpoint saved and resumed under FSDP2, and two GPUs over NCCL
(marked gpu).

The ranks are subprocesses running this file (`python tests/test_fsdp.py RANK WORLD PORT DIR MODE`), so
nothing depends on how pytest imports the test module.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

LEARNING_RATE = 0.5  # SGD: the update is linear in the gradients, so a wrongly scaled gradient shows
NO_CLIPPING = 1e6  # the norm is still computed (over sharded gradients) but never rescales
CLIP_NORM = 0.02  # well below the step's gradient norm: the second step is clipped
FLOAT32_FLOOR = 1e-6  # a few float32 ulps of weights of order 1: rounding, not a different update


# --- the fixed step ----------------------------------------------------------------------------------------


def samples() -> list[Any]:
    """Two groups of two rollouts; the groups train different numbers of tokens, so a loss normalised per
    row instead of per micro-batch (or gradients averaged instead of summed) would differ."""
    from harness.types import TrainingSample, TrainingSequence

    generator = torch.Generator().manual_seed(0)
    out = []
    for group, (prompt_len, completion_lens, advantages) in enumerate(
        [(6, (5, 7), (1.0, -1.0)), (4, (3, 2), (0.5, -0.5))]
    ):
        prompt = torch.randint(20, 1000, (prompt_len,), generator=generator).tolist()
        for completion_len, advantage in zip(completion_lens, advantages, strict=True):
            completion = torch.randint(20, 1000, (completion_len,), generator=generator).tolist()
            ids = prompt + completion
            mask = [0] * prompt_len + [1] * completion_len
            # near a random model's log-probs (about -log(vocab)), so most ratios stay inside the IS range
            old = [0.0] * prompt_len + (
                -7.3 + 0.3 * torch.randn(completion_len, generator=generator)
            ).tolist()
            topk: list[Any] = [None] * prompt_len
            for token in completion:
                ids_k = [token, *torch.randint(20, 1000, (3,), generator=generator).tolist()]
                topk.append({i: -7.0 - 0.1 * k for k, i in enumerate(dict.fromkeys(ids_k))})
            sequence = TrainingSequence(ids, mask, old, topk, [None] * len(ids), rollout_id=f"g{group}")
            out.append(TrainingSample(sequence, advantage, group))
    return out


# The fake servers' client threads, closed when a rank (or the one-process reference) is done with them.
SERVER_THREADS = contextlib.ExitStack()


class FakeWorker:
    """Stands in for the rollout worker: held by its token allowance with nothing more to send, so a step
    trains on the samples already pending."""

    held = True
    finished = False

    def get(self, timeout_s: float) -> None:
        return None

    def set_model_version(self, version: int) -> None:
        self.version = version


def make_trainer(output_dir: str, tied: bool = False, lora: bool = False, **overrides: Any) -> Any:
    from harness import AsyncGRPOTrainer
    from harness.config import AsyncGRPOConfig
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    settings: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=1,
        gradient_checkpointing=False,
        optim="sgd",
        optim_args="momentum=0.9",  # optimizer state, for the checkpoint to carry
        learning_rate=LEARNING_RATE,
        max_grad_norm=NO_CLIPPING,
        weight_sync_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(overrides)
    args = AsyncGRPOConfig(**settings)
    dataset = [{"prompt": [{"role": "user", "content": "hi"}]}]
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)  # LoRA's A matrices: the same on every rank and in the reference
    trainer = AsyncGRPOTrainer(
        build_tiny_qwen3(tie_word_embeddings=tied),
        reward_funcs=[constant_reward],
        args=args,
        train_dataset=dataset,
        processing_class=build_tiny_tokenizer(),
        peft_config=peft_config,
    )
    return trainer


def constant_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def prepare(trainer: Any, resume: str | None = None) -> Any:
    """What `train()` sets up before its loop, without the server and the worker (fakes on rank 0): the
    weight sync it opens for a built-in server on this host, merged weights through a file."""
    from harness.generation.client_thread import ClientThread
    from harness.testing import FakeGenerationServer
    from harness.weight_sync.strategies import MergedWeightSync
    from harness.weight_sync.transports import FileTransfer

    trainer._setup_run(resume)
    trainer._token_budget = 1024
    server = None
    if trainer._is_main:  # keeps the weights each file sync sends
        server = SERVER_THREADS.enter_context(ClientThread(client=FakeGenerationServer()))
    trainer._weight_sync = MergedWeightSync(
        FileTransfer(), server, is_main=trainer._is_main, world_size=trainer.args.world_size
    )
    if trainer._is_main:
        trainer.worker = FakeWorker()
    return trainer


def step(trainer: Any, max_grad_norm: float) -> dict[str, Any]:
    """One real step on the fixed samples: rank 0 plans and broadcasts, each rank trains its rows, the
    optimizer steps, the weights are synced to the fake server on rank 0."""
    plans: list[Any] = []
    train_on_plan = trainer._train_on_plan

    def recording(plan_rows: dict[str, Any]) -> dict[str, float]:
        plans.append(plan_rows)
        return train_on_plan(plan_rows)

    trainer._train_on_plan = recording
    trainer.args.max_grad_norm = max_grad_norm
    if trainer._is_main:
        trainer.pending = samples()
    started = time.monotonic()
    try:
        metrics = trainer._train_step()
    finally:
        del trainer._train_on_plan
    step_s = time.monotonic() - started
    trainer.state.global_step += 1
    return {
        "metrics": metrics,
        "plan": [[[s.sequence.rollout_id for s in row] for row in mb] for mb in plans[-1]["micro_batches"]],
        "synced": dict(trainer._weight_sync.server.client.weights) if trainer._is_main else None,
        "step_s": step_s,
    }


def run_steps(trainer: Any, clipping: tuple[float, ...] = (NO_CLIPPING, CLIP_NORM)) -> list[dict[str, Any]]:
    """Two steps: the first does not clip the gradient norm, the second clips it to CLIP_NORM (a norm taken
    over the sharded gradients)."""
    prepare(trainer)
    return [step(trainer, max_grad_norm) for max_grad_norm in clipping]


def full_parameters(model: Any) -> dict[str, torch.Tensor]:
    """The merged weights, on every rank (under FSDP2 all-gathered in buckets)."""
    from harness.weight_sync.peft import merged_named_parameters

    weights = merged_named_parameters(model, all_ranks=True)
    return {name: tensor.detach().cpu().clone() for name, tensor in weights}


# --- one rank of the two-process run ---------------------------------------------------------------------


def rank_main(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    precision, device, *rest = mode.split("-")
    overrides: dict[str, Any] = {"bf16": precision == "bf16", "use_cpu": device == "cpu"}
    if rest == ["tied"]:
        overrides.update(tied=True, gradient_checkpointing=True)
    if rest == ["lora"]:
        overrides.update(lora=True)
    if rest == ["compiled"]:
        import functools

        from harness.compiled_blocks import compile_blocks
        from harness.training import trainer as trainer_module

        # AOTAutograd without code generation: the graphs and their interplay with FSDP2 that inductor gets,
        # in seconds on a CPU
        trainer_module.compile_blocks = functools.partial(compile_blocks, backend="aot_eager")
        overrides.update(compile_blocks=True)
    output_dir = str(Path(out_dir) / "out")  # shared by the ranks, as checkpoints need
    with SERVER_THREADS:
        rank_steps(rank, world, out_dir, precision, output_dir, overrides)


def rank_steps(
    rank: int, world: int, out_dir: str, precision: str, output_dir: str, overrides: dict[str, Any]
) -> None:
    trainer = make_trainer(output_dir, **overrides)
    assert trainer.args.world_size == world and trainer.args.process_index == rank
    steps = run_steps(trainer)
    from torch.distributed.tensor import DTensor

    model = trainer.model
    sharded = {
        name: (
            isinstance(p, DTensor),
            str(p.dtype),
            tuple(p.to_local().shape) if isinstance(p, DTensor) else None,
            tuple(p.shape),
        )
        for name, p in model.named_parameters()
    }
    optimizer_dtypes = sorted(
        {str(p.dtype) for group in trainer.optimizer.param_groups for p in group["params"]}
    )
    # the gather helper once more, outside the sync: every rank joins, each gets the full tensors
    gathered = full_parameters(model)
    model_version = trainer.counters.model_version
    resumed_diff = None
    if precision == "fp32":
        # a checkpoint written under FSDP2 resumes under FSDP2: weights (LoRA: the adapter), momentum, and the
        # next step
        directory = trainer.save_checkpoint()
        resumed = prepare(make_trainer(output_dir, **overrides), resume=str(directory))
        assert resumed.state.global_step == trainer.state.global_step == 2
        assert max_abs_diff(full_parameters(resumed.model), gathered) == 0
        continued = step(trainer, NO_CLIPPING)
        after_resume = step(resumed, NO_CLIPPING)
        if rank == 0:
            resumed_diff = max_abs_diff(after_resume["synced"], continued["synced"])
    result = {
        "steps": steps,
        "compiled": sorted(n for n, m in model.named_modules() if m._compiled_call_impl is not None),
        "sharded": sharded,
        "optimizer_dtypes": optimizer_dtypes,
        "gathered": gathered,
        "model_version": model_version,
        "resumed_diff": resumed_diff,
    }
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(result, handle)
    import torch.distributed as dist

    from harness.training.processes import end_process_group

    dist.barrier()
    end_process_group()  # and gloo's workers idle before the interpreter exits


# --- the tests --------------------------------------------------------------------------------------------


def launch(tmp_path: Path, mode: str, world: int = 2) -> list[dict[str, Any]]:
    """Run `world` ranks of `rank_main` as subprocesses (gloo on CPU, NCCL on GPUs); their results."""
    from harness.testing.ranks import run_ranks

    run_ranks([sys.executable, __file__], tmp_path, world_size=world, extra_args=[str(tmp_path), mode])
    results = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as handle:
            results.append(pickle.load(handle))
    return results


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def parameters_of(tied: bool) -> dict[str, torch.Tensor]:
    from harness.testing import build_tiny_qwen3

    model = build_tiny_qwen3(tie_word_embeddings=tied)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def initial_parameters() -> dict[str, torch.Tensor]:
    return parameters_of(tied=False)


def one_process_steps(output_dir: str, **overrides: Any) -> list[dict[str, Any]]:
    """The reference: the same steps in this process alone (world size 1, no process group)."""
    with SERVER_THREADS:
        return one_process_run(output_dir, **overrides)


def one_process_run(output_dir: str, **overrides: Any) -> list[dict[str, Any]]:
    trainer = make_trainer(output_dir, **overrides)
    assert trainer.args.world_size == 1
    steps = run_steps(trainer)
    assert max_abs_diff(steps[-1]["synced"], full_parameters(trainer.model)) == 0
    # the clipping does bite: without it the second step lands elsewhere
    unclipped = run_steps(make_trainer(output_dir, **overrides), (NO_CLIPPING, NO_CLIPPING))
    moved = max_abs_diff(steps[-1]["synced"], steps[0]["synced"])
    assert max_abs_diff(unclipped[-1]["synced"], steps[-1]["synced"]) > 0.05 * moved, moved
    return steps


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict[str, Any]]:
    return one_process_steps(str(tmp_path_factory.mktemp("one") / "out"))


def check_like_one_process(
    ranks: list[dict[str, Any]],
    reference: list[dict[str, Any]],
    initial: dict[str, torch.Tensor],
    *,
    tolerance: float,
) -> list[tuple[float, float, float]]:
    """The two-rank steps against the one-process steps: per step |loss diff|, max |param diff|, update."""
    rank0, rank1 = ranks

    # the policy is sharded: every parameter a DTensor holding half of the rows (FSDP2, dim-0 shards)
    for name, (is_dtensor, _, local_shape, full_shape) in rank0["sharded"].items():
        assert is_dtensor, name
        assert local_shape[0] == (full_shape[0] + 1) // 2, name

    measured = []
    before = initial
    for index, (step0, step1, expected) in enumerate(
        zip(rank0["steps"], rank1["steps"], reference, strict=True)
    ):
        # rank 0 planned one row per rank (one group each) and fed rank 1 the same plan
        assert step0["plan"] == step1["plan"]
        assert len(step0["plan"]) == 1 and [sorted(set(row)) for row in step0["plan"][0]] == [["g0"], ["g1"]]

        # the loss is the whole step's (every row's), the same on both ranks, and equal to one process's
        loss, reference_loss = step0["metrics"]["loss"], expected["metrics"]["loss"]
        assert loss == step1["metrics"]["loss"]
        loss_diff = abs(loss - reference_loss)
        assert loss_diff <= tolerance * max(abs(reference_loss), 1.0), (index, loss, reference_loss)
        for name in ("entropy", "sampling/importance_sampling_ratio/mean", "sampling/sampler_mass"):
            value, reference_value = step0["metrics"][name], expected["metrics"][name]
            assert value == pytest.approx(reference_value, rel=10 * tolerance, abs=1e-6), (index, name)

        # the step moved the weights as one process does (SGD: update = lr * summed, maybe clipped, gradient),
        # and rank 0's client got them from the weight sync
        update = max_abs_diff(expected["synced"], before)
        assert update > 1e-4
        param_diff = max_abs_diff(step0["synced"], expected["synced"])
        assert param_diff <= tolerance * update + FLOAT32_FLOOR, (index, param_diff, update)
        measured.append((loss_diff, param_diff, update))
        before = expected["synced"]

    # (the second step was clipped, to the norm over all shards, else the ranks' updates would differ)
    # the gather helper gives every rank the full parameters
    for gathered in (rank0["gathered"], rank1["gathered"]):
        assert max_abs_diff(gathered, reference[-1]["synced"]) <= tolerance * measured[-1][2] + FLOAT32_FLOOR
    assert rank0["model_version"] == rank1["model_version"] == len(reference)
    return measured


def report(label: str, measured: list[tuple[float, float, float]]) -> None:
    print(f"\n{label}:")
    for index, (loss_diff, param_diff, update) in enumerate(measured):
        print(
            f"  step {index}: |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g} "
            f"(max update {update:.3g})"
        )


def test_two_gloo_processes_train_like_one_process(tmp_path, one_process, initial_parameters):
    ranks = launch(tmp_path, "fp32-cpu")
    measured = check_like_one_process(ranks, one_process, initial_parameters, tolerance=1e-5)
    report("2 gloo ranks vs 1 process (fp32)", measured)
    # a third step after saving a checkpoint and resuming from it equals the third step of the run itself
    assert ranks[0]["resumed_diff"] == 0


def test_tied_embeddings_two_gloo_processes_train_like_one_process(tmp_path):
    """Tied input and output embeddings (Qwen3-0.6B to 4B) share one parameter, in the tail group; with
    gradient checkpointing (the config's default), whose recomputation gathers the layers again."""
    reference = one_process_steps(str(tmp_path / "one" / "out"), tied=True, gradient_checkpointing=True)
    (tmp_path / "two").mkdir()
    ranks = launch(tmp_path / "two", "fp32-cpu-tied")
    assert "lm_head.weight" not in ranks[0]["sharded"]  # one parameter, under the embedding's name
    measured = check_like_one_process(ranks, reference, parameters_of(tied=True), tolerance=1e-5)
    report("2 gloo ranks vs 1 process (fp32, tied embeddings, gradient checkpointing)", measured)
    assert ranks[0]["resumed_diff"] == 0


def test_lora_two_gloo_processes_sync_merged_weights_like_one_process(tmp_path, initial_parameters):
    """A LoRA policy under FSDP2: the adapter is sharded too, and the weight sync merges each layer's delta,
    computed from the sharded adapter and gathered, into the gathered base weight. The adapter's checkpoint
    resumes under FSDP2 to the same next step."""
    reference = one_process_steps(str(tmp_path / "one" / "out"), lora=True)
    (tmp_path / "two").mkdir()
    ranks = launch(tmp_path / "two", "fp32-cpu-lora")
    assert any(".lora_A." in name for name in ranks[0]["sharded"])
    measured = check_like_one_process(ranks, reference, initial_parameters, tolerance=1e-5)
    report("2 gloo ranks vs 1 process (fp32, LoRA, merged sync)", measured)
    assert ranks[0]["resumed_diff"] == 0


def test_compiled_blocks_two_gloo_processes_train_like_one_eager_process(
    tmp_path, one_process, initial_parameters
):
    """compile_blocks before FSDP2 shards the layers (the final norm then runs FSDP's hooks inside its
    compiled call, sharded with the head): two ranks through AOTAutograd train, sync and resume like one
    eager process."""
    ranks = launch(tmp_path, "fp32-cpu-compiled")
    assert ranks[0]["compiled"] == ranks[1]["compiled"]
    assert "model.norm" in ranks[0]["compiled"] and any(n.endswith(".mlp") for n in ranks[0]["compiled"])
    measured = check_like_one_process(ranks, one_process, initial_parameters, tolerance=1e-5)
    report("2 gloo ranks, compiled blocks, vs 1 eager process (fp32)", measured)
    assert ranks[0]["resumed_diff"] == 0


def test_one_process_given_two_rows_trains_like_two_processes(tmp_path, one_process, initial_parameters):
    """The normalisation is per micro-batch across rows: one process training both rows of a two-row plan
    (one after the other) steps like one process training the single row it plans itself."""
    from harness.packing import plan_micro_batches

    trainer = make_trainer(str(tmp_path / "out"))
    trainer._setup_run(None)
    pending = samples()
    plan = plan_micro_batches(pending, num_rows=2, token_budget=1024)
    rows = [[[pending[i] for i in row.sample_indices] for row in mb.rows] for mb in plan.micro_batches]
    assert len(rows) == 1 and all(rows[0])
    trained = [sum(s.sequence.num_trained for s in row) for row in rows[0]]
    assert trained[0] != trained[1]  # a per-row normalisation would weigh tokens differently
    metrics = trainer._train_on_plan({"micro_batches": rows})
    params = full_parameters(trainer.model)
    expected = one_process[0]
    assert metrics["loss"] == pytest.approx(expected["metrics"]["loss"], rel=1e-6)
    update = max_abs_diff(expected["synced"], initial_parameters)
    assert max_abs_diff(params, expected["synced"]) <= 1e-5 * update + FLOAT32_FLOOR


def check_bf16(
    ranks: list[dict[str, Any]], reference: list[dict[str, Any]], initial: Any
) -> tuple[float, float]:
    """bf16 under FSDP2 (the reference's mixed precision): float32 sharded parameters (the optimizer's master
    weights), the forward and backward in bf16; the first step stays close to the float32 one."""
    rank0, rank1 = ranks
    assert {dtype for _, dtype, _, _ in rank0["sharded"].values()} == {"torch.float32"}
    assert rank0["optimizer_dtypes"] == ["torch.float32"]
    step0, step1, expected = rank0["steps"][0], rank1["steps"][0], reference[0]
    assert step0["metrics"]["loss"] == step1["metrics"]["loss"]
    loss_diff = abs(step0["metrics"]["loss"] - expected["metrics"]["loss"])
    assert 0 < loss_diff <= 5e-2 * max(abs(expected["metrics"]["loss"]), 1.0)  # bf16 compute does show
    update = max_abs_diff(expected["synced"], initial)
    diff = max_abs_diff(step0["synced"], expected["synced"])
    assert diff <= 0.1 * update, (diff, update)
    return loss_diff, diff


def test_bf16_mixed_precision_keeps_float32_master_weights(tmp_path, one_process, initial_parameters):
    loss_diff, diff = check_bf16(launch(tmp_path, "bf16-cpu"), one_process, initial_parameters)
    print(f"\nbf16 2 gloo ranks vs fp32 1 process: |loss diff| {loss_diff:.3g}, max |param diff| {diff:.3g}")


@pytest.mark.gpu
def test_two_nccl_gpus_train_like_one_gpu(tmp_path, initial_parameters):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    reference = one_process_steps(str(tmp_path / "one"), use_cpu=False)
    (tmp_path / "fp32").mkdir()
    ranks = launch(tmp_path / "fp32", "fp32-cuda")
    report(
        "2 NCCL ranks vs 1 GPU (fp32)",
        check_like_one_process(ranks, reference, initial_parameters, tolerance=1e-4),
    )
    (tmp_path / "bf16").mkdir()
    loss_diff, diff = check_bf16(launch(tmp_path / "bf16", "bf16-cuda"), reference, initial_parameters)
    print(f"bf16 2 NCCL ranks vs fp32 1 GPU: |loss diff| {loss_diff:.3g}, max |param diff| {diff:.3g}")


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])

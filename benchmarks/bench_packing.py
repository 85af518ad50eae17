"""Benchmark: tree-packed against unpacked training micro-steps, MFU, peak memory, and the log-prob head.

Run (H200, the figures in the docs):   PYTHONPATH=. python benchmarks/bench_packing.py --out bench.json
Run (CPU smoke test, tiny shapes):     PYTHONPATH=. python benchmarks/bench_packing.py --preset tiny

Workload: a random model shaped like Qwen3-1.7B (hidden 2048, 28 layers, 16 query / 8 KV heads of dim 128,
vocabulary 151936, tied embeddings, bf16, gradient checkpointing) trains on `--groups` groups of
`--group-size` completions of `--completion-tokens` tokens after a `--prompt-tokens`-token prompt. The same
samples are planned twice under the same token budget, with prefixes shared (tree packing) and without
(each sample its own segment: plain padding-free packing), and each plan runs the trainer's micro-step:
packed_forward -> fused_policy_loss (the chunked head and score centering with 8 sampler top-k ids per
token, in one pass) -> backward. Reported:

* the time of the whole step (all rows) for both plans, their ratio, and the packing ratio beside it; and
  the packed step with the modular head (row_logprobs then policy_loss), for the fused head's saving;
* fwd+bwd MFU against the bf16 dense peak (989 TFLOP/s): model FLOPs of the layers (6 x parameters x
  forwarded tokens), of attention (12 x layers x heads x head_dim x query-key pairs actually on a path) and
  of the LM head (6 x hidden x vocabulary x trained tokens), over the measured time; gradient
  checkpointing's recomputation is not counted as useful work;
* peak GPU memory of each step;
* the log-prob head alone at `--head-tokens` tokens: chunked (modular and fused) against materialised
  logits (log_softmax over [tokens, vocabulary] in float32), peak memory above the inputs, and time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from harness.packing import PackedRow, batch_metrics, pack_row, plan_micro_batches
from harness.testing.models import QWEN3_SHAPES, QWEN_VOCAB_SIZE
from harness.training.attention import packed_forward, prepare_model_for_tree_attention
from harness.training.flops import peak_flops
from harness.training.logprobs import (
    _mixed_precision_matmul_works,
    fused_token_loss,
    row_logprobs,
    token_logprobs,
)
from harness.training.loss import LossConfig, fused_policy_loss, policy_loss
from harness.types import TrainingSample, TrainingSequence

PEAK_BF16_FLOPS = peak_flops("NVIDIA H200", half_precision=True)  # H100/H200 SXM dense bf16


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


def _shape_of(dims: dict[str, int], vocab: int) -> Shape:
    return Shape(
        hidden=dims["hidden_size"],
        layers=dims["num_hidden_layers"],
        heads=dims["num_attention_heads"],
        kv_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"],
        intermediate=dims["intermediate_size"],
        vocab=vocab,
    )


PRESETS = {
    "qwen3-1.7b": _shape_of(QWEN3_SHAPES["qwen3-1.7b"], QWEN_VOCAB_SIZE),
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512),
}


def build_model(shape: Shape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype)


def make_samples(args: argparse.Namespace, vocab: int) -> list[TrainingSample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for group in range(args.groups):
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.group_size):
            completion = torch.randint(0, vocab, (args.completion_tokens,), generator=generator).tolist()
            ids = prompt + completion
            n, m = len(ids), len(completion)
            old = (-torch.rand(m, generator=generator) * 2).tolist()
            topk = []
            for token in completion:  # the sampled token and 7 others, as num_sampler_logprobs=8 returns
                others = torch.randint(0, vocab, (7,), generator=generator).tolist()
                topk.append({token: -0.5, **{o: -3.0 - 0.1 * i for i, o in enumerate(others) if o != token}})
            sequence = TrainingSequence(
                input_ids=ids,
                loss_mask=[0] * args.prompt_tokens + [1] * m,
                old_log_probs=[0.0] * args.prompt_tokens + old,
                sampler_logprobs=[None] * args.prompt_tokens + topk,
                sampling_mask=[None] * n,
            )
            advantage = float(torch.randn(1, generator=generator))
            samples.append(TrainingSample(sequence=sequence, advantage=advantage, group_id=group))
    return samples


def model_flops(rows: list[PackedRow], shape: Shape) -> float:
    layer_params = shape.layers * (
        shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
        + 3 * shape.hidden * shape.intermediate
    )
    tokens = sum(row.num_tokens for row in rows)
    pairs = sum(row.attention_pairs for row in rows)
    trained = sum(row.num_trained for row in rows)
    return (
        6 * layer_params * tokens
        + 12 * shape.layers * shape.heads * shape.head_dim * pairs
        + 6 * shape.hidden * shape.vocab * trained
    )


_STARTED = time.perf_counter()


def _clock() -> str:
    return f"t={time.perf_counter() - _STARTED:.0f}s"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(
    model: torch.nn.Module,
    rows: list[PackedRow],
    config: LossConfig,
    chunk_size: int,
    fused: bool,
    trace: bool = False,
) -> float:
    """One optimizer step's micro-batches on this process (one row each); returns the summed loss.

    With `trace`, print when the forward, the head and loss, and the backward of each row end (after a
    device synchronisation), which separates compilation of the forward and backward kernels.
    """

    def mark(stage: str) -> None:
        if trace:
            synchronize(rows[0].input_ids.device)
            print(f"    {stage} done ({_clock()})", flush=True)

    weight = model.get_output_embeddings().weight
    # One process: a micro-batch's global count is its own row's, but normalising by the step's count makes
    # the two plans' losses comparable (they train the same tokens).
    num_trained = sum(row.num_trained for row in rows)
    losses = []
    for row in rows:
        hidden = packed_forward(model, row)
        mark("forward")
        if fused:
            out = fused_policy_loss(
                hidden, row, weight, config, num_trained_tokens_global=num_trained, chunk_size=chunk_size
            )
        else:
            head = row_logprobs(hidden, row, weight, chunk_size=chunk_size)
            out = policy_loss(head, row, config, num_trained_tokens_global=num_trained)
        mark("head and loss")
        out.loss.backward()
        mark("backward")
        losses.append(out.loss.detach())
    return float(torch.stack(losses).sum())


def measure_plan(
    name: str,
    model: torch.nn.Module,
    rows: list[PackedRow],
    shape: Shape,
    args: argparse.Namespace,
    device: torch.device,
    fused: bool = True,
) -> dict[str, Any]:
    config = LossConfig()
    row_s: list[float] = []
    for _ in range(args.warmup):  # row by row, so that compilation shows and a cut-short run still informs
        for row in rows:
            synchronize(device)
            start = time.perf_counter()
            run_step(model, [row], config, args.chunk_size, fused, trace=not row_s)
            synchronize(device)
            row_s.append(time.perf_counter() - start)
            print(f"  {name} warm-up row {len(row_s)}: {row_s[-1] * 1e3:.0f} ms ({_clock()})", flush=True)
        model.zero_grad(set_to_none=True)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], 0.0
    for _ in range(args.iters):
        synchronize(device)
        start = time.perf_counter()
        loss = run_step(model, rows, config, args.chunk_size, fused)
        synchronize(device)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    step_s = statistics.median(times)
    flops = model_flops(rows, shape)
    result = {
        "rows": len(rows),
        "forwarded_tokens": sum(row.num_tokens for row in rows),
        "trained_tokens": sum(row.num_trained for row in rows),
        "step_s": step_s,
        "step_s_all": times,
        "warmup_row_s": row_s,
        "model_tflops": flops / 1e12,
        "mfu": flops / step_s / PEAK_BF16_FLOPS,
        "loss": loss,
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(
        f"  {name:9s} rows={result['rows']} tokens={result['forwarded_tokens']} step={step_s * 1e3:.0f} ms "
        f"MFU={result['mfu'] * 100:.1f}%"
        + (f" peak={result['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in result else ""),
        flush=True,
    )
    return result


def measure_head(
    args: argparse.Namespace, shape: Shape, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """The head alone at args.head_tokens tokens: chunked against materialised float32 log-softmax."""
    generator = torch.Generator(device=device).manual_seed(0)
    n = args.head_tokens
    hidden = torch.randn(n, shape.hidden, device=device, dtype=dtype, generator=generator).requires_grad_()
    weight = (
        torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype, generator=generator) * 0.02
    ).requires_grad_()
    targets = torch.randint(0, shape.vocab, (n,), device=device, generator=generator)

    def chunked() -> torch.Tensor:
        logprobs = token_logprobs(hidden, weight, targets, chunk_size=args.chunk_size).logprobs
        logprobs.sum().backward()
        return logprobs

    def minus_sum(rows: slice, logprobs: torch.Tensor, topk: torch.Tensor | None) -> tuple:
        return -logprobs.sum(), -torch.ones_like(logprobs), None

    def fused() -> torch.Tensor:
        loss, head = fused_token_loss(hidden, weight, targets, minus_sum, chunk_size=args.chunk_size)
        (-loss).backward()
        return head.logprobs

    def materialised() -> torch.Tensor:
        logits = hidden @ weight.t()
        logprobs = logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0]
        logprobs.sum().backward()
        return logprobs

    result: dict[str, Any] = {
        "tokens": n,
        "float32_output_matmul": _mixed_precision_matmul_works(device.type, dtype),
    }
    reference = None
    for name, head in (("chunked", chunked), ("fused", fused), ("materialised", materialised)):
        timings = []
        for _ in range(3):
            hidden.grad = weight.grad = None
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            try:
                logprobs = head()
            except torch.OutOfMemoryError:
                result[name] = {"error": "out of memory"}
                break
            synchronize(device)
            timings.append(time.perf_counter() - start)
            values = logprobs.detach()
            del logprobs
        else:
            entry = {"fwd_bwd_s": statistics.median(timings)}
            if device.type == "cuda":
                entry["peak_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
            result[name] = entry
            if reference is None:
                reference = values
            else:
                result[name]["max_abs_logprob_difference_to_chunked"] = float(
                    (reference - values).abs().max()
                )
        print(f"  head {name:12s} {result[name]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-1.7b")
    parser.add_argument("--groups", type=int, default=15)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=15360)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--head-tokens", type=int, default=32768)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--skip-head", action="store_true", help="skip the head-alone memory comparison")
    parser.add_argument(
        "--skip-modular", action="store_true", help="skip timing the packed step's modular head"
    )
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if args.preset == "tiny" and args.prompt_tokens == 1024:  # keep the CPU smoke test quick
        args.groups, args.prompt_tokens, args.completion_tokens, args.token_budget = 3, 48, 16, 176
        args.head_tokens, args.chunk_size, args.warmup, args.iters = 512, 128, 1, 2

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = PRESETS[args.preset]
    command = "PYTHONPATH=. python " + " ".join(sys.argv)
    print(f"command: {command}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"device: {device_name or 'cpu'}")
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, dtype {dtype}", flush=True)
    results: dict[str, Any] = {"command": command, "args": vars(args), "torch": torch.__version__}

    def save() -> None:  # after every stage, so a failure later keeps what was measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)

    if not args.skip_head:
        results["head"] = measure_head(args, shape, device, dtype)
        save()

    samples = make_samples(args, shape.vocab)
    print(f"samples ready ({_clock()})", flush=True)
    model = prepare_model_for_tree_attention(build_model(shape, device, dtype))
    print(f"model ready ({_clock()})", flush=True)
    model.train()
    if not args.no_gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    for name, share in (("packed", True), ("unpacked", False)):
        plan = plan_micro_batches(samples, num_rows=1, token_budget=args.token_budget, share_prefixes=share)
        assert not plan.leftover and not plan.dropped_oversize
        rows = [
            pack_row([samples[i] for i in mb.rows[0].sample_indices], share_prefixes=share).to(device)
            for mb in plan.micro_batches
        ]
        results[name] = measure_plan(name, model, rows, shape, args, device)
        results[name]["batch"] = batch_metrics(plan)
        save()
        if share and not args.skip_modular:
            results["packed_modular_head"] = measure_plan(
                "modular", model, rows, shape, args, device, fused=False
            )

    packing_ratio = results["packed"]["batch"]["batch/packing_ratio"]
    speedup = results["unpacked"]["step_s"] / results["packed"]["step_s"]
    results["speedup"] = speedup
    results["packing_ratio"] = packing_ratio
    results["speedup_over_packing_ratio"] = speedup / packing_ratio
    print(
        f"speed-up {speedup:.2f}x at packing ratio {packing_ratio:.2f} "
        f"({speedup / packing_ratio:.2f} of it; bar 0.90)",
        flush=True,
    )
    save()


if __name__ == "__main__":
    main()

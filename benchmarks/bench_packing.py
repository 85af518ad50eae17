"""Benchmark: tree-packed against unpacked training micro-steps, MFU, peak memory, and the log-prob head.

Run (H200, the figures in the docs):   PYTHONPATH=. python benchmarks/bench_packing.py --out bench.json
Run (CPU smoke test, tiny shapes):     PYTHONPATH=. python benchmarks/bench_packing.py --preset tiny
Length sweep (H200):                   PYTHONPATH=. python benchmarks/bench_packing.py --sweep --out s.json
Length sweep (CPU smoke test):         PYTHONPATH=. python benchmarks/bench_packing.py --sweep --preset tiny

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

`--sweep` measures rows of about 4k, 8k, 16k and 32k unique tokens instead (a group of 8 completions after a
1k, 2k, 4k or 8k-token prompt, each row one micro-batch), and a 16k row of multi-turn rollouts whose second
turn re-rendered the end of the first (they fork). Each workload runs three ways on the same samples with the
same fused head: (a) tree-packed (the default attention backend: varlen in bf16, full-attention layers as a
cascade over the row in place; on a GPU each layer's norms and MLP compiled, as the trainer does there:
harness/compiled_blocks.py, `--no-compile` to leave them eager), (b) our unpacked padding-free
row, (c) a plain transformers model with its stock SDPA attention on the samples as a padded batch, all
eager, the head applied to its hidden states at the same tokens. For each:
the first call (compilation included), the steady step (median), trained and forwarded
tokens/s, MFU and peak memory; on a GPU also (a) with its compiled blocks run eagerly (`a_tree_eager`),
(a) with the fallback layout that gathers each segment's path
(`a_tree_gather`), at 4k (a) with the flex backend, and at 16k (a) with the modular head. Beside the
packing ratio, the model FLOPs ratio ((c)'s model FLOPs over (a)'s): the speed-up (a) would have over (c) at
equal MFU. With --no-gradient-checkpointing, --micro-batch-samples 2 runs (b) and (c) in micro-batches of two
samples (gradients accumulated), as they must to fit at 16k-32k; a way that runs out of memory is recorded
as such and the others still run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from harness.compiled_blocks import compile_blocks
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
            # near a random model's log-probs (about -log V), so most tokens pass the importance-ratio mask
            old = (-math.log(vocab) - torch.rand(m, generator=generator) * 0.2).tolist()
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


SWEEP_LENGTHS = {4096: 1024, 8192: 2048, 16384: 4096, 32768: 8192}  # row length: prompt length


def sweep_samples(prompt_tokens: int, completion_tokens: int, vocab: int, seed: int) -> list[TrainingSample]:
    """One group of 8 completions after one prompt, as make_samples builds them."""
    args = argparse.Namespace(
        groups=1, group_size=8, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
    )
    torch.manual_seed(seed)
    return make_samples(args, vocab)


def forking_samples(row_tokens: int, vocab: int) -> list[TrainingSample]:
    """8 two-turn rollouts of one prompt; each gives two samples: its first turn as sampled, and its second
    turn after a history whose last tokens (16 in a 16k row) were re-rendered differently (a fork there)."""
    generator = torch.Generator().manual_seed(1)
    prompt_len, first, tool = row_tokens // 4, row_tokens // 32, row_tokens // 64
    rerendered = max(2, row_tokens // 1024)
    second = (row_tokens - prompt_len) // 8 - first - tool - rerendered
    prompt = torch.randint(0, vocab, (prompt_len,), generator=generator).tolist()

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def trained(context: list[int], completions: list[tuple[int, int]]) -> TrainingSample:
        n = len(context)
        mask = [0] * n
        for start, end in completions:
            mask[start:end] = [1] * (end - start)
        old = [-math.log(vocab) if m else 0.0 for m in mask]
        sequence = TrainingSequence(context, mask, old, [None] * n, [None] * n)
        return TrainingSample(
            sequence=sequence, advantage=float(torch.randn(1, generator=generator)), group_id=0
        )

    samples = []
    for _ in range(8):
        turn1 = ids(first)
        history = prompt + turn1[:-rerendered] + ids(rerendered) + ids(tool)
        turn2 = ids(second)
        samples.append(trained(prompt + turn1, [(prompt_len, prompt_len + first)]))
        samples.append(trained(history + turn2, [(len(history), len(history) + second)]))
    return samples


def plain_step(
    model: torch.nn.Module,
    batches: list[tuple[PackedRow, list[TrainingSample]]],
    config: LossConfig,
    chunk: int,
) -> float:
    """(c): the stock model (SDPA) on each micro-batch of samples as a padded batch, gradients accumulated;
    the same fused head on its hidden states, laid out as the micro-batch's unpacked row (each sample's
    tokens in turn), normalised by the step's trained tokens."""
    num_trained = sum(row.num_trained for row, _ in batches)
    losses = []
    for row, samples in batches:
        device = row.input_ids.device
        lengths = [len(s.sequence.input_ids) for s in samples]
        batch = torch.zeros(len(samples), max(lengths), dtype=torch.long, device=device)
        attention = torch.zeros_like(batch)
        for b, sample in enumerate(samples):
            batch[b, : lengths[b]] = torch.tensor(sample.sequence.input_ids, device=device)
            attention[b, : lengths[b]] = 1
        decoder = model.get_decoder()
        hidden = decoder(input_ids=batch, attention_mask=attention, use_cache=False).last_hidden_state
        hidden_T_H = torch.cat([hidden[b, : lengths[b]] for b in range(len(samples))])
        out = fused_policy_loss(
            hidden_T_H, row, model.get_output_embeddings().weight, config,
            num_trained_tokens_global=num_trained, chunk_size=chunk,
        )  # fmt: skip
        out.loss.backward()
        losses.append(out.loss.detach())
    return float(torch.stack(losses).sum())


def measure_way(
    name: str, step: Any, flops: float, tokens: tuple[int, int], device: torch.device, iters: int
) -> dict[str, Any]:
    """First call (compilation included), then the median of `iters` steady calls of `step()`."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loss = step()
    synchronize(device)
    first = time.perf_counter() - start
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        loss = step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    forwarded, trained = tokens
    result = {
        "first_call_s": first,
        "step_s": step_s,
        "step_s_all": times,
        "trained_tokens_per_s": trained / step_s,
        "forwarded_tokens_per_s": forwarded / step_s,
        "mfu": flops / step_s / PEAK_BF16_FLOPS,
        "loss": loss,
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(
        f"    {name:14s} first {first:7.2f} s  step {step_s * 1e3:8.1f} ms  "
        f"{trained / step_s:9.0f} trained tok/s  MFU {result['mfu'] * 100:5.1f}%"
        + (f"  peak {result['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in result else ""),
        flush=True,
    )
    return result


def run_sweep(
    args: argparse.Namespace, shape: Shape, device: torch.device, dtype: torch.dtype, save: Any
) -> dict[str, Any]:
    from harness.training.attention import ATTENTION_NAME

    model = prepare_model_for_tree_attention(build_model(shape, device, dtype))
    model.train()
    if not args.no_gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = device.type == "cuda" and not args.no_compile
    if compiled:  # as the trainer does on a CUDA device; (c) and a_tree_eager run with it switched off
        compile_blocks(model)
    config = LossConfig()
    scale = 1 if device.type == "cuda" else 64  # CPU smoke test: the same shapes, 64 times shorter
    workloads = []
    for length, prompt in SWEEP_LENGTHS.items():
        if args.sweep_max_tokens and length > args.sweep_max_tokens:
            continue
        samples = sweep_samples(prompt // scale, (length - prompt) // 8 // scale, shape.vocab, seed=length)
        workloads.append((f"{length // 1024}k", samples, length == 4096, length == 16384))
    if not args.sweep_max_tokens or args.sweep_max_tokens >= 16384:
        workloads.append(("16k-multiturn", forking_samples(16384 // scale, shape.vocab), False, False))
    results: dict[str, Any] = {}
    if args.sweep_lengths:
        keep = set(args.sweep_lengths.split(","))
        workloads = [w for w in workloads if w[0] in keep]
    for name, samples, with_flex, with_modular in workloads:
        tree = pack_row(samples).to(device)
        flat = pack_row(samples, share_prefixes=False).to(device)
        # (b) and (c) in micro-batches of --micro-batch-samples samples (one micro-batch when 0)
        per_batch = args.micro_batch_samples or len(samples)
        batches = [samples[i : i + per_batch] for i in range(0, len(samples), per_batch)]
        flat_rows = [pack_row(batch, share_prefixes=False).to(device) for batch in batches]
        entry: dict[str, Any] = {
            "samples": len(samples),
            "tree_tokens": tree.num_tokens,
            "unpacked_tokens": flat.num_tokens,
            "trained_tokens": tree.num_trained,
            "packing_ratio": flat.num_tokens / tree.num_tokens,
            # the speed-up at equal MFU: the unpacked samples' model FLOPs over the tree's (attention pairs
            # shrink less than tokens, as each completion still attends to its whole prompt)
            "flops_ratio": model_flops([flat], shape) / model_flops([tree], shape),
        }
        print(
            f"  {name}: {len(samples)} samples, {tree.num_tokens} tree tokens, {flat.num_tokens} unpacked "
            f"(packing ratio {entry['packing_ratio']:.2f}) ({_clock()})",
            flush=True,
        )
        chunk = args.chunk_size
        ways: list[tuple[str, Any, PackedRow]] = [
            ("a_tree", functools.partial(run_step, model, [tree], config, chunk, True), tree),
            ("b_unpacked", functools.partial(run_step, model, flat_rows, config, chunk, True), flat),
        ]
        if compiled:  # the same step with every compiled block run eagerly: what compile_blocks saves
            ways.append(
                (
                    "a_tree_eager",
                    functools.partial(_eager, run_step, model, [tree], config, chunk, True),
                    tree,
                )
            )
        if device.type == "cuda":  # the fallback layout: each segment's path gathered (K/V copied)
            gather = functools.partial(_with_backend, model, tree, config, chunk, "varlen_gather")
            ways.append(("a_tree_gather", gather, tree))
        if with_flex and device.type == "cuda":
            ways.append(
                ("a_tree_flex", functools.partial(_with_backend, model, tree, config, chunk, "flex"), tree)
            )
        if with_modular:
            ways.append(
                (
                    "a_tree_modular_head",
                    functools.partial(run_step, model, [tree], config, chunk, False),
                    tree,
                )
            )
        plain_batches = list(zip(flat_rows, batches, strict=True))
        plain = functools.partial(_eager, plain_step, model, plain_batches, config, chunk)
        ways.append(("c_plain_sdpa", plain, flat))
        for way, step, row in ways:
            tokens = (row.num_tokens, row.num_trained)
            if way == "c_plain_sdpa":
                model.set_attn_implementation("sdpa")
            try:
                entry[way] = measure_way(way, step, model_flops([row], shape), tokens, device, args.iters)
            except torch.OutOfMemoryError:  # recorded, and the other ways still run
                entry[way] = {"error": "out of memory"}
                print(f"    {way:14s} out of memory", flush=True)
            finally:
                model.set_attn_implementation(ATTENTION_NAME)
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if args.profile and name == args.profile:
            model.set_attn_implementation("sdpa")
            profile("c_plain_sdpa", plain)
            model.set_attn_implementation(ATTENTION_NAME)
            profile("a_tree", functools.partial(run_step, model, [tree], config, chunk, True))
            model.zero_grad(set_to_none=True)
        plain_s, tree_s = entry["c_plain_sdpa"].get("step_s"), entry["a_tree"].get("step_s")
        if plain_s and tree_s:
            entry["tree_speedup_over_plain"] = plain_s / tree_s
            entry["speedup_over_packing_ratio"] = entry["tree_speedup_over_plain"] / entry["packing_ratio"]
            entry["speedup_over_flops_ratio"] = entry["tree_speedup_over_plain"] / entry["flops_ratio"]
            print(
                f"    tree {entry['tree_speedup_over_plain']:.2f}x faster than plain at packing ratio "
                f"{entry['packing_ratio']:.2f} ({entry['speedup_over_packing_ratio']:.2f} of it; bar 0.90), "
                f"model FLOPs ratio {entry['flops_ratio']:.2f} "
                f"({entry['speedup_over_flops_ratio']:.2f} of it)",
                flush=True,
            )
        results[name] = entry
        save(results)  # after every workload: a run cut short keeps what it measured
    return results


def profile(name: str, step: Any) -> None:
    """Print the CUDA kernels that take the most time in one step (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    step()  # warm
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
    print(f"  profile of {name}:")
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60))


def _eager(step: Any, *args: Any) -> Any:
    """`step(*args)` with every torch.compile'd function run eagerly (the stock model of (c))."""
    with torch.compiler.set_stance("force_eager"):
        return step(*args)


def _with_backend(
    model: torch.nn.Module, row: PackedRow, config: LossConfig, chunk: int, backend: str
) -> float:
    weight = model.get_output_embeddings().weight
    hidden = packed_forward(model, row, backend=backend)  # type: ignore[arg-type]
    out = fused_policy_loss(
        hidden, row, weight, config, num_trained_tokens_global=row.num_trained, chunk_size=chunk
    )
    out.loss.backward()
    return float(out.loss.detach())


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
    parser.add_argument(
        "--no-compile", action="store_true", help="sweep: leave the norms and MLPs eager (compile_blocks off)"
    )
    parser.add_argument("--skip-head", action="store_true", help="skip the head-alone memory comparison")
    parser.add_argument(
        "--skip-modular", action="store_true", help="skip timing the packed step's modular head"
    )
    parser.add_argument("--sweep", action="store_true", help="the length sweep (see the module docstring)")
    parser.add_argument("--sweep-max-tokens", type=int, default=0, help="leave out longer sweep rows")
    parser.add_argument("--sweep-lengths", default="", help="only these sweep workloads (e.g. 16k,32k)")
    parser.add_argument("--profile", default="", help="profile one step of (a) and (c) at this workload")
    parser.add_argument(
        "--micro-batch-samples",
        type=int,
        default=0,
        help="sweep: run (b) and (c) in micro-batches of this many samples (0: all in one), as a run "
        "without gradient checkpointing must to fit",
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

    if args.sweep:

        def save_sweep(sweep: dict[str, Any]) -> None:
            results["sweep"] = sweep
            save()

        run_sweep(args, shape, device, dtype, save_sweep)
        return
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

"""Sampling for the built-in server: per-request parameters, processed log-probs, seeded draws.

Who talks to it: the engine calls `launch_sampling` once per forward pass with the last-position logits of
every row and each row's `SamplingParams` and `RequestRandom`, and reads the step with `result()`, at once
or (async scheduling) after launching the next forward; `sample_next_tokens` does both in one call. A decode
step whose rows all sample by temperature alone (`samples_in_graph`) is instead sampled inside its CUDA
graph (`cuda_graphs.StepGraphs.decode_and_sample`), which records `draw_tokens`, the same operations
`launch_sampling` queues after processing the logits, and the engine wraps its outputs in a `PendingSample`.

Log-prob semantics follow vLLM's `--logprobs-mode processed_logprobs`: the reported log-probs are those of
the distribution actually sampled from, after (in this order) the repetition penalty, temperature, min-p and
top-k / top-p masking, renormalised over the surviving candidates; masked tokens get -inf. A greedy request
(temperature below 1e-5) is processed at temperature 1 and takes the arg-max. Temperatures below 0.01 are
raised to 0.01, as vLLM does.

Seeds: each request owns a `RequestRandom` (a Python RNG seeded with the request's seed, or from the OS when
it has none) that draws one uniform number per generated token; the token is found by inverse-CDF on the
processed distribution. The draw therefore depends on the request's seed and its own logits only, never on
which other requests share the batch: the same seed gives the same tokens.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import torch

from harness.server.device_copies import to_device

GREEDY_TEMPERATURE = 1e-5
MIN_TEMPERATURE = 0.01
CDF_BLOCK = 1024  # tokens per block of the two-level inverse-CDF search (`inverse_cdf`)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, with vLLM's names and meanings.

    Attributes:
        max_tokens: Most tokens to generate.
        temperature: Softmax temperature; below 1e-5 means greedy.
        top_p: Nucleus mass in (0, 1]; 1 disables it.
        top_k: Keep the k most likely tokens; 0 or -1 disables it.
        min_p: Drop tokens whose probability is below min_p times the largest; 0 disables it.
        repetition_penalty: Divide positive (multiply negative) logits of tokens already in the prompt or the
            output by this; 1 disables it.
        seed: Seed of this request's random draws; None draws one from the OS.
        num_logprobs: None: no log-probs; 0: the sampled token's; K: also the K most likely per position.
        stop_token_ids: Tokens that end the request (kept in the output), besides the model's EOS.
        ignore_eos: Keep generating past EOS (benchmarks).
        return_sampling_mask: Also report each token's candidate set when the distribution is truncated
            (vLLM's --return-sampling-mask, here per request).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    num_logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_sampling_mask: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.num_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def applied_temperature(self) -> float:
        """What the logits are divided by: 1 for a greedy request, else the temperature, at least 0.01."""
        return 1.0 if self.greedy else max(self.temperature, MIN_TEMPERATURE)

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p leave only part of the vocabulary to draw from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0


class RequestRandom:
    """A request's own stream of uniform draws in [0, 1), reproducible from its seed."""

    def __init__(self, seed: int | None) -> None:
        self._rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))

    def uniform(self) -> float:
        return self._rng.random()


@dataclass
class SampledTokens:
    """The outcome of one sampling step, as Python lists (one device-to-host copy per step).

    Attributes:
        token_ids_B: The sampled token of each row.
        logprobs_B: Its processed log-prob.
        top_B: Per row, the (token id, log-prob) pairs of its num_logprobs most likely tokens, most likely
            first ([] when the row asked for none).
        candidates_B: Per row that asked for it (`return_sampling_mask`) and whose distribution is truncated
            (top-k, top-p, min-p), the ids it could have drawn: its candidate set; else None.
    """

    token_ids_B: list[int]
    logprobs_B: list[float]
    top_B: list[list[tuple[int, float]]]
    candidates_B: list[list[int] | None]


def processed_logprobs(
    logits_BV: torch.Tensor, params_B: list[SamplingParams], seen_tokens_B: list[list[int]]
) -> torch.Tensor:
    """The processed log-probs [B, V] (float32) of each row's sampling distribution; see the module doc."""
    return torch.log_softmax(processed_logits(logits_BV, params_B, seen_tokens_B), dim=-1)


def processed_logits(
    logits_BV: torch.Tensor, params_B: list[SamplingParams], seen_tokens_B: list[list[int]]
) -> torch.Tensor:
    """The logits in float32 after each row's repetition penalty, temperature and masks (-inf).

    Never modifies `logits_BV`: the result is a new tensor, except for float32 logits that no row
    processes (temperature 1, no penalty, no truncation: the usual rollout), which are returned as they
    are rather than copied. On the dev machine's 2 CPU cores (`python benchmarks/bench_sampling.py
    --device cpu --dtype float32 --rows 64 256 --logprobs 1`, three rounds, before and after in turn) a
    sampling step (the middle round's median) went from 38 to 31 ms at 64 rows and from 138 to 115 ms at
    256 (greedy: 35 to 24, 128 to 87).
    """
    vocab_size = logits_BV.shape[-1]
    device = logits_BV.device
    penalised: list[tuple[int, int, float]] = [  # (row, token, penalty) for every token a row has seen
        (row, token, params.repetition_penalty)
        for row, params in enumerate(params_B)
        if params.repetition_penalty != 1.0
        for token in set(seen_tokens_B[row])
    ]
    temperatures = [p.applied_temperature for p in params_B]
    processed = bool(penalised) or any(t != 1.0 for t in temperatures) or any(p.truncates for p in params_B)
    logits_BV = logits_BV.to(torch.float32, copy=processed)
    if penalised:  # one copy for every row's tokens
        rows, tokens, penalties = to_device(penalised, torch.float64, device).unbind(dim=1)
        rows, tokens = rows.long(), tokens.long()
        values = logits_BV[rows, tokens]
        penalties = penalties.float()
        logits_BV[rows, tokens] = torch.where(values > 0, values / penalties, values * penalties)
    if any(t != 1.0 for t in temperatures):
        logits_BV /= to_device(temperatures, torch.float32, device)[:, None]
    min_p_rows = [row for row, p in enumerate(params_B) if p.min_p > 0]
    if min_p_rows:
        index = to_device(min_p_rows, torch.long, device)
        probs = torch.softmax(logits_BV[index], dim=-1)
        threshold = to_device([params_B[r].min_p for r in min_p_rows], torch.float32, device)[:, None]
        drop = probs < threshold * probs.max(dim=-1, keepdim=True).values
        logits_BV[index] = logits_BV[index].masked_fill(drop, float("-inf"))
    truncated_rows = [row for row, p in enumerate(params_B) if p.top_k > 0 or p.top_p < 1.0]
    if truncated_rows:
        index = to_device(truncated_rows, torch.long, device)
        logits_BV[index] = _top_k_top_p(
            logits_BV[index],
            top_k=[params_B[r].top_k if params_B[r].top_k > 0 else vocab_size for r in truncated_rows],
            top_p=[params_B[r].top_p for r in truncated_rows],
        )
    return logits_BV


def _top_k_top_p(logits_RV: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k, then outside its top-p nucleus of what is left."""
    device = logits_RV.device
    sorted_logits, order = logits_RV.sort(dim=-1, descending=True)
    ranks = torch.arange(logits_RV.shape[-1], device=device)[None, :]
    k = to_device(top_k, torch.long, device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token stays while the mass of the tokens ranked above it is below p: the smallest prefix reaching p
    # survives, and the most likely token always does.
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    p = to_device(top_p, torch.float32, device)[:, None]
    sorted_logits = sorted_logits.masked_fill(mass_above >= p, float("-inf"))
    return torch.empty_like(logits_RV).scatter_(-1, order, sorted_logits)


def sample_next_tokens(
    logits_BV: torch.Tensor,
    params_B: list[SamplingParams],
    randoms_B: list[RequestRandom],
    seen_tokens_B: list[list[int]],
) -> SampledTokens:
    """Process each row's logits, draw its next token and collect the log-probs it asked for."""
    return launch_sampling(logits_BV, params_B, randoms_B, seen_tokens_B).result()


class PendingSample:
    """One sampling step queued on the device, read with `result()`.

    `token_ids_B` (on the device) can feed the next forward before the host has read anything: that is how
    the engine launches a decode step ahead (`Engine`'s async scheduling). On a GPU the packed results travel
    to pinned host memory by an asynchronous copy followed by an event, so `result()` waits for this step
    only, not for work queued after it. The tensors given may be buffers the next step overwrites (a CUDA
    graph's outputs, `StepGraphs.decode_and_sample`): the packed results are copied at once, to pinned
    memory on a GPU, and on a CPU (where the next step runs before this one is read) both are cloned.
    """

    def __init__(
        self,
        token_ids_B: torch.Tensor,
        packed_BC: torch.Tensor,
        num_top: int,
        params_B: list[SamplingParams],
        finite_MV: torch.Tensor | None,
    ) -> None:
        self.token_ids_B = token_ids_B
        self._num_top = num_top
        self._params_B = params_B
        self._finite_MV = finite_MV  # rows asking for their candidate set: which tokens stayed finite
        self._packed_BC = packed_BC
        self._event: torch.cuda.Event | None = None
        if packed_BC.device.type == "cpu":
            self.token_ids_B, self._packed_BC = token_ids_B.clone(), packed_BC.clone()
        elif packed_BC.device.type == "cuda":
            self._packed_BC = torch.empty(packed_BC.shape, dtype=packed_BC.dtype, pin_memory=True)
            self._packed_BC.copy_(packed_BC, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Block until the step's results are on the host."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> SampledTokens:
        self.wait()
        packed = self._packed_BC.tolist()
        num_top = self._num_top
        top_B: list[list[tuple[int, float]]] = []
        for row, params in enumerate(self._params_B):
            count = params.num_logprobs or 0
            if count == 0:
                top_B.append([])
            elif count == 1:
                top_B.append([(int(packed[row][2]), packed[row][2 + num_top])])
            else:
                ids, values = packed[row][2 : 2 + count], packed[row][2 + num_top : 2 + num_top + count]
                top_B.append([(int(i), v) for i, v in zip(ids, values, strict=True)])
        candidates_B: list[list[int] | None] = [None] * len(self._params_B)
        masked_rows = masked_rows_of(self._params_B)
        finite_MV = self._finite_MV
        if finite_MV is not None:  # one copy for all of them: each row's count, then their ids
            counts_and_ids = torch.cat([finite_MV.sum(dim=-1), finite_MV.nonzero()[:, 1]]).tolist()
            start = len(masked_rows)
            for row, count in zip(masked_rows, counts_and_ids[: len(masked_rows)], strict=True):
                candidates_B[row] = counts_and_ids[start : start + count]
                start += count
        return SampledTokens(
            token_ids_B=[int(row[0]) for row in packed],
            logprobs_B=[row[1] for row in packed],
            top_B=top_B,
            candidates_B=candidates_B,
        )


def launch_sampling(
    logits_BV: torch.Tensor,
    params_B: list[SamplingParams],
    randoms_B: list[RequestRandom],
    seen_tokens_B: list[list[int]],
) -> PendingSample:
    """Queue the processing, the draw and the log-probs of one step on the logits' device; nothing waits."""
    logits_BV = processed_logits(logits_BV, params_B, seen_tokens_B)
    device = logits_BV.device
    # One host-to-device copy in (each row's uniform draw, -1 for greedy rows) and one device-to-host copy
    # out (`PendingSample`); on a GPU both are asynchronous (pinned memory), so the host never waits here
    # for the forward that made the logits.
    uniforms = draw_uniforms(params_B, randoms_B)
    num_top = min(max((p.num_logprobs or 0) for p in params_B), logits_BV.shape[-1])
    draws_B = None if all(u < 0 for u in uniforms) else to_device(uniforms, torch.float32, device)
    tokens_B, packed_BC = draw_tokens(logits_BV, draws_B, num_top)
    masked_rows = masked_rows_of(params_B)
    finite_MV = None
    if masked_rows:
        finite_MV = torch.isfinite(logits_BV[to_device(masked_rows, torch.long, device)])
    return PendingSample(tokens_B, packed_BC, num_top, params_B, finite_MV)


def draw_uniforms(params_B: list[SamplingParams], randoms_B: list[RequestRandom]) -> list[float]:
    """This step's draw of each row from its own stream; -1 for a greedy row, which draws nothing."""
    return [-1.0 if p.greedy else r.uniform() for p, r in zip(params_B, randoms_B, strict=True)]


def draw_tokens(
    logits_BV: torch.Tensor, draws_B: torch.Tensor | None, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and the log-probs reported, from processed float32 logits: ([B] token ids, [B, C]
    packed float64 columns: token, its log-prob, then the `num_top` most likely ids and their log-probs).

    `draws_B` holds each row's uniform draw, negative for a greedy row (its arg-max); None: every row is
    greedy. Only tensor operations, no host reads: a CUDA graph may record it (`cuda_graphs.py`).
    """
    # A log-prob is a logit minus its row's log-partition, found as log_softmax finds it (the maximum plus
    # the log of the sum of exp(logit - maximum)), so only the log-probs reported are ever formed, and the
    # draw searches the unnormalised weights exp(logit - maximum).
    best_B, argmax_B = logits_BV.max(dim=-1)
    weights_BV = torch.sub(logits_BV, best_B[:, None], out=_workspace(logits_BV)).exp_()
    log_total_B = best_B + weights_BV.sum(dim=-1).log()
    if draws_B is None:
        tokens = argmax_B
    else:
        drawn = inverse_cdf(weights_BV, draws_B.clamp(min=0), blocked=searches_by_block(logits_BV.device))
        tokens = torch.where(draws_B < 0, argmax_B, drawn)
    token_logprobs = logits_BV.gather(-1, tokens[:, None]).squeeze(-1) - log_total_B
    columns = [tokens.double()[:, None], token_logprobs.double()[:, None]]
    if num_top == 1:  # the maximum already found: no top-k pass, and a greedy token is its row's top-1
        columns += [argmax_B.double()[:, None], (best_B - log_total_B).double()[:, None]]
    elif num_top > 1:
        top_values, top_ids = logits_BV.topk(num_top, dim=-1)
        columns += [top_ids.double(), (top_values - log_total_B[:, None]).double()]
    return tokens, torch.cat(columns, dim=1)


def draw_scaled_tokens(
    logits_BV: torch.Tensor, temperatures_B: torch.Tensor, draws_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_tokens` with the top-1 log-prob, of each row's logits (any float dtype) divided in float32 by
    its temperature: the whole sampling a decode step's graph records (`cuda_graphs.StepGraphs`)."""
    return draw_tokens(logits_BV.float() / temperatures_B[:, None], draws_B, num_top=1)


_cpu_workspace = threading.local()  # per thread: each engine samples on its own


def _workspace(like_BV: torch.Tensor) -> torch.Tensor:
    """A float32 tensor shaped as `like_BV`, for results used within one sampling call.

    On a CPU it is one buffer per thread, reused from call to call: a fresh [rows, vocabulary] tensor is
    tens of megabytes, which the C allocator maps anew each time, and touching its fresh pages cost more
    than the arithmetic done in them (on the dev machine, 64 rows x 151,936 tokens: 11 ms to subtract a
    maximum into a new tensor, 1.6 ms into the reused one). It grows to the largest batch seen and lives as
    long as the thread. On a GPU, PyTorch's caching allocator already reuses memory, and a buffer shared
    between steps would have to wait for the step in flight: a new tensor each call.
    """
    if like_BV.device.type != "cpu":
        return torch.empty(like_BV.shape, dtype=torch.float32, device=like_BV.device)
    size = like_BV.numel()
    buffer: torch.Tensor | None = getattr(_cpu_workspace, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _cpu_workspace.buffer = torch.empty(size, dtype=torch.float32)
    return buffer[:size].view(like_BV.shape)


def samples_in_graph(params_B: list[SamplingParams]) -> bool:
    """Whether every row's sampling is its temperature alone (no repetition penalty, no top-k, top-p or
    min-p) with at most its top-1 log-prob: what a decode step's CUDA graph records with the step
    (`StepGraphs.decode_and_sample`), the same operations `launch_sampling` queues for such rows."""
    return all(
        p.repetition_penalty == 1.0 and not p.truncates and (p.num_logprobs or 0) <= 1 for p in params_B
    )


def masked_rows_of(params_B: list[SamplingParams]) -> list[int]:
    """The rows that report their candidate set (`return_sampling_mask`) and whose distribution is cut."""
    return [row for row, p in enumerate(params_B) if p.return_sampling_mask and p.truncates]


# How `inverse_cdf` searches: "auto" (by device, `searches_by_block`), "blocks" or "rows" everywhere. The
# benchmarks set it to compare the two (`bench_sampling.py --search`, `bench_decode_step.py --search`).
SEARCH_CHOICES = ("auto", "blocks", "rows")
SEARCH = "auto"


def searches_by_block(device: torch.device) -> bool:
    """Whether `inverse_cdf` searches in two levels of `CDF_BLOCK` tokens on this device (`SEARCH`).

    On the dev machine's CPU the blocks win (a sampled step of 64 rows x 151,936 tokens: 32 ms instead of
    74); on an H100 the one scan wins, its kernels being few and the blocks' many (0.82 ms instead of 1.17).
    `python benchmarks/bench_sampling.py --search blocks rows` measures both.
    """
    if SEARCH not in SEARCH_CHOICES:
        raise ValueError(f"sampling.SEARCH is {SEARCH!r}; set it to one of {', '.join(SEARCH_CHOICES)}")
    return device.type == "cpu" if SEARCH == "auto" else SEARCH == "blocks"


def inverse_cdf(probs_BV: torch.Tensor, uniforms_B: torch.Tensor, *, blocked: bool = True) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds `uniform x the row's total mass`.

    `blocked` searches in two levels of `CDF_BLOCK` tokens: the block sums' cumulative sum finds the block,
    then a cumulative sum over that block alone finds the token (a cumulative sum along the whole vocabulary
    is a scan of 150k values per row, slow on a CPU; block sums are a plain reduction, and the two scans left
    are short). Otherwise one cumulative sum over the row is searched. Scaling by the total mass keeps a draw
    inside the distribution, and a token of zero probability is never returned: where rounding puts a target
    at or past the end of a level's mass, its last entry of positive mass is taken.
    """
    if not blocked:
        cdf_BV = torch.cumsum(probs_BV, dim=-1)
        return _first_above(probs_BV, cdf_BV, (uniforms_B * cdf_BV[:, -1])[:, None]).squeeze(-1)
    num_rows, vocab_size = probs_BV.shape
    whole = vocab_size // CDF_BLOCK * CDF_BLOCK
    sums = [probs_BV[:, :whole].reshape(num_rows, -1, CDF_BLOCK).sum(dim=-1)] if whole else []
    if whole < vocab_size:
        sums.append(probs_BV[:, whole:].sum(dim=-1, keepdim=True))
    block_sums_BK = torch.cat(sums, dim=1)
    block_cdf_BK = torch.cumsum(block_sums_BK, dim=-1)
    targets_B1 = (uniforms_B * block_cdf_BK[:, -1])[:, None]
    block_B1 = _first_above(block_sums_BK, block_cdf_BK, targets_B1)
    mass_before_B1 = block_cdf_BK.gather(-1, block_B1) - block_sums_BK.gather(-1, block_B1)
    columns_BC = block_B1 * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs_BV.device)
    inside_BC = columns_BC < vocab_size  # the last block may be partial
    probs_BC = probs_BV.gather(-1, columns_BC.clamp(max=vocab_size - 1)) * inside_BC
    residual_B1 = (targets_B1 - mass_before_B1).clamp_(min=0)
    within_B1 = _first_above(probs_BC, torch.cumsum(probs_BC, dim=-1), residual_B1)
    return (block_B1 * CDF_BLOCK + within_B1).squeeze(-1)


def _first_above(mass_BK: torch.Tensor, cdf_BK: torch.Tensor, targets_B1: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds the target, else the last of positive mass."""
    found_B1 = torch.searchsorted(cdf_BK, targets_B1, right=True)
    # int32 positions: over a whole row this is a [rows, vocabulary] pass, half the bytes of int64's.
    positions_K = torch.arange(mass_BK.shape[-1], device=mass_BK.device, dtype=torch.int32)
    last_positive_B1 = torch.where(mass_BK > 0, positions_K, -1).max(dim=-1, keepdim=True).values
    return torch.minimum(found_B1, last_positive_B1)

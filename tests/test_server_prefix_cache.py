"""The built-in server's prefix cache: reused keys must give what a full prefill gives.

Each engine test runs the same requests through an engine with the prefix cache and one without, and
checks equal tokens and log-probs (float32, tiny random Qwen3), plus the hit counters, so a reuse that
copied the wrong positions, crossed adapters or weight versions, or missed entirely would show.
"""

from __future__ import annotations

import pytest
import torch
from engine_requests import run_requests

from harness.server.engine import Engine, GenerationOutput
from harness.server.kv_cache import RowKVCache
from harness.server.prefix_cache import BLOCK_SIZE, PrefixCache, StoredPrefix
from harness.server.sampling import SamplingParams
from harness.testing import build_tiny_qwen3

MAX_MODEL_LEN = 160
PROMPT = [(7 * i + 3) % 900 + 20 for i in range(45)]  # 45 tokens: two full blocks and a partial one


def make_engine(model: torch.nn.Module, *, prefix: bool, kv_cache_tokens: int = 2048) -> Engine:
    engine = Engine(
        model,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=[],
        max_num_seqs=16,
        kv_cache_tokens=kv_cache_tokens,
        enable_prefix_caching=prefix,
    )
    engine.start()
    return engine


def assert_same(with_cache: list[GenerationOutput], without: list[GenerationOutput]) -> None:
    for cached, plain in zip(with_cache, without, strict=True):
        assert cached.output_ids == plain.output_ids
        assert cached.logprobs == pytest.approx(plain.logprobs, abs=1e-5)


def conversation(engine: Engine) -> list[GenerationOutput]:
    """Two turns: the second prompt is the first turn's prompt and output, then new tokens (a tool
    result), as a multi-turn rollout sends them."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, num_logprobs=0)
    (first,) = run_requests(engine, [PROMPT], [greedy])
    run_requests(engine, [[900 - i for i in range(50)]], [greedy])  # another rollout reuses the cache row
    second_prompt = PROMPT + first.output_ids + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    (second,) = run_requests(engine, [second_prompt], [greedy])
    return [first, second]


def test_a_later_turn_reuses_the_turn_before_it_and_matches_a_full_prefill():
    cached_engine = make_engine(build_tiny_qwen3(), prefix=True)
    plain_engine = make_engine(build_tiny_qwen3(), prefix=False)
    try:
        cached, plain = conversation(cached_engine), conversation(plain_engine)
        stats, plain_stats = cached_engine.stats(), plain_engine.stats()
    finally:
        cached_engine.close()
        plain_engine.close()
    assert_same(cached, plain)
    # The second turn's keys for the first prompt and all but the last output token came from the store.
    assert stats.num_prefix_cache_hits == len(PROMPT) + 12 - 1
    assert stats.num_prefix_cache_queries == len(PROMPT) + 50 + len(cached[1].prompt_ids)
    assert stats.prefix_cache_enabled and not plain_stats.prefix_cache_enabled
    assert plain_stats.num_prefix_cache_hits == 0


def test_a_group_sharing_one_prompt_prefills_it_once():
    # Eight sampled rollouts of one prompt, submitted together as the rollout worker does for a group.
    # A ninth request shares only its first 30 tokens: on CPU it waits one step, then reuses them.
    params = [SamplingParams(max_tokens=10, temperature=1.0, num_logprobs=0, seed=s) for s in range(9)]
    prompts = [PROMPT] * 8 + [[*PROMPT[:30], 1, 2, 3, 4, 5]]
    cached_engine = make_engine(build_tiny_qwen3(), prefix=True)
    plain_engine = make_engine(build_tiny_qwen3(), prefix=False)
    try:
        # together: a member of the group taken a step late would copy the keys from the running row
        # but recompute its last token (one hit fewer), as the CI of d09ef17 saw once on a loaded machine
        cached = run_requests(cached_engine, prompts, params, together=True)
        plain = run_requests(plain_engine, prompts, params, together=True)
        stats = cached_engine.stats()
    finally:
        cached_engine.close()
        plain_engine.close()
    assert_same(cached, plain)
    assert len({tuple(o.output_ids) for o in cached}) > 1  # sampled: the rollouts did diverge
    # One prefill: the other seven took its keys and its last logits (then sampled with their own seeds).
    assert stats.num_prefix_cache_hits == 7 * len(PROMPT) + 30


def test_a_weight_change_and_a_reset_forget_the_cached_prefixes():
    model = build_tiny_qwen3()
    engine = make_engine(model, prefix=True)
    new_weights = build_tiny_qwen3(seed=5).state_dict()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, num_logprobs=0)
    try:
        run_requests(engine, [PROMPT], [greedy])
        engine.call(engine.reset_prefix_cache).result(10)
        run_requests(engine, [PROMPT], [greedy])
        assert engine.stats().num_prefix_cache_hits == 0

        def swap() -> None:
            model.load_state_dict(new_weights)
            engine.invalidate_cache()

        engine.call(swap).result(10)
        (after,) = run_requests(engine, [PROMPT], [greedy])
        hits = engine.stats().num_prefix_cache_hits
    finally:
        engine.close()
    assert hits == 0
    plain = make_engine(build_tiny_qwen3(seed=5), prefix=False)
    try:
        assert_same([after], run_requests(plain, [PROMPT], [greedy]))
    finally:
        plain.close()


def test_keys_computed_under_an_adapter_are_not_reused_without_it(tmp_path):
    peft = pytest.importorskip("peft")
    from harness.server.lora import LoraManager

    adapted = peft.get_peft_model(
        build_tiny_qwen3(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])
    )
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, param in adapted.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would make the adapter a no-op
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, num_logprobs=0)
    outputs = {}
    for prefix in (True, False):
        model = build_tiny_qwen3()
        lora = LoraManager(model)
        adapter = lora.load("a", tmp_path / "adapter")
        engine = make_engine(model, prefix=prefix)
        try:
            (with_adapter,) = run_requests(engine, [PROMPT], [greedy], adapter=adapter)
            (base,) = run_requests(engine, [PROMPT], [greedy])
            (again,) = run_requests(engine, [PROMPT], [greedy], adapter=adapter)
            outputs[prefix] = (with_adapter, base, again, engine.stats().num_prefix_cache_hits)
        finally:
            engine.close()
            lora.close()
    assert_same(list(outputs[True][:3]), list(outputs[False][:3]))
    assert outputs[True][0].output_ids != outputs[True][1].output_ids  # the adapter changes the output
    # Only the third request (the adapter again) reused keys: the first one's, for its prompt.
    assert outputs[True][3] == len(PROMPT) - 1


def test_the_store_stays_within_the_kv_budget_and_evicts_the_oldest():
    engine = make_engine(build_tiny_qwen3(), prefix=True, kv_cache_tokens=664)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, num_logprobs=0)
    prompts = [[100 + 40 * k + i for i in range(40)] for k in range(6)]
    try:
        for prompt in prompts:
            run_requests(engine, [prompt], [greedy])
            store = engine.prefix_cache
            assert store is not None
            cache = engine.cache
            assert (
                store.stored_tokens + cache.allocated_rows * cache.allocated_length <= cache.capacity_tokens
            )
            assert len(store) <= 2  # 8 rows x 64 positions leave room for two entries of 43
        # The first prompt was evicted, the last one is still there.
        (_first_again,) = run_requests(engine, [prompts[0]], [greedy])
        misses = engine.stats().num_prefix_cache_hits
        (_last_again,) = run_requests(engine, [prompts[-1]], [greedy])
        hits = engine.stats().num_prefix_cache_hits - misses
    finally:
        engine.close()
    assert misses == 0
    assert hits == len(prompts[-1]) - 1


def _cache() -> RowKVCache:
    return RowKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_rows=2,
        max_length=64,
        capacity_tokens=256,
    )


class _Running:
    def __init__(self, tokens: list[int], adapter=None):
        self.tokens, self.adapter, self.num_cached = tokens, adapter, len(tokens)


def test_lookup_extends_past_whole_blocks_and_skips_stale_sources():
    index = PrefixCache(_cache())
    source = _Running(list(range(40)))
    index.add_running(source)
    # Shares 37 tokens: two whole blocks found by hash, then five more token by token.
    hit = index.lookup([*list(range(37)), 999, 998], None)
    assert (hit.length, hit.source) == (37, source)
    # A new request always keeps its last token to compute.
    assert index.lookup(list(range(40)), None).length == 39
    assert index.lookup(list(range(BLOCK_SIZE)), None).length == 0  # shorter than a block + 1
    assert index.lookup(list(range(40)), adapter=object()).length == 0  # other adapter
    source.num_cached = 0  # preempted: its row no longer holds the keys
    assert index.lookup(list(range(40)), None).length == 0


def test_retire_stores_a_copy_that_outlives_the_row():
    cache = _cache()
    cache.reserve(2, 64)
    index = PrefixCache(cache)
    request = _Running(list(range(20)))
    keys = torch.arange(20 * 2, dtype=torch.float32).reshape(1, 20, 2)
    cache.load_row(0, torch.stack([keys, keys + 1000])[:, None], 20)
    index.add_running(request)
    index.retire(request, row=0)
    cache.load_row(0, torch.zeros(2, 1, 1, 20, 2), 20)  # the row is reused
    hit = index.lookup([*list(range(20)), 5], None)
    assert isinstance(hit.source, StoredPrefix) and hit.length == 20
    stored_keys, stored_values = hit.source.keys_and_values[:, 0]
    assert torch.equal(stored_keys, keys) and torch.equal(stored_values, keys + 1000)
    index.clear()
    assert index.lookup([*list(range(20)), 5], None).length == 0 and index.stored_tokens == 0


def test_row_copies_keep_each_layers_keys_and_values_in_place():
    # Several layers and heads, keys and values distinct everywhere: copy_row, load_row and move_row must
    # carry each (keys or values, layer) slice to the same place, and only the positions asked for.
    cache = RowKVCache(
        num_layers=3,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_rows=4,
        max_length=32,
        capacity_tokens=80,  # 4 rows and the scratch row of 16 positions
    )
    cache.reserve(3, 16)
    filled = torch.arange(2 * 3 * 3 * 2 * 16 * 4, dtype=torch.float32).reshape(2, 3, 3, 2, 16, 4)
    cache.load_row(0, filled[:, :, 0], 16)
    cache.load_row(1, filled[:, :, 1], 16)
    for layer in range(3):
        keys, values = cache.rows(layer, 2, 16)
        assert torch.equal(keys, filled[0, layer, :2]) and torch.equal(values, filled[1, layer, :2])
    stored = cache.copy_row(1, 5)
    assert stored.shape == (2, 3, 2, 5, 4) and torch.equal(stored, filled[:, :, 1, :, :5])
    cache.move_row(0, 2, 7)  # compaction: row 0's first 7 positions into row 2
    cache.load_row(0, stored, 5)  # row 0 now starts with row 1's first 5 positions
    for layer in range(3):
        keys, values = cache.rows(layer, 3, 16)
        for kind, got in enumerate((keys, values)):
            assert torch.equal(got[0, :, :5], filled[kind, layer, 1, :, :5])
            assert torch.equal(got[0, :, 5:], filled[kind, layer, 0, :, 5:])  # past the copy: untouched
            assert torch.equal(got[2, :, :7], filled[kind, layer, 0, :, :7])
            assert not got[2, :, 7:].any()
    before = [tuple(t.clone() for t in cache.rows(layer, 2, 16)) for layer in range(3)]
    assert cache.allocated_length == 16
    cache.reserve(2, 32)  # the storage grows: every layer's keys and values stay where they were
    assert cache.allocated_length == 32
    for layer in range(3):
        keys, values = cache.rows(layer, 2, 32)
        assert torch.equal(keys[:, :, :16], before[layer][0])
        assert torch.equal(values[:, :, :16], before[layer][1])
        assert not keys[:, :, 16:].any() and not values[:, :, 16:].any()

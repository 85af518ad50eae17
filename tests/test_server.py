"""Contract tests of the built-in server over real HTTP, driven by GenerationClient, on a tiny Qwen3.

One server per module (an EmbeddedServer on a thread, random port). Every numeric check compares against
a direct forward pass of an identical model built the same way (`build_tiny_qwen3()`, seed 0), with the
processed log-probs recomputed here by a plain per-position implementation. Tests that change the
server's weights restore them before they end. Weight updates are driven the way the trainer drives
them: `harness.weight_sync.strategies.MergedWeightSync` with a file or a broadcast transfer, through a
`ClientThread`.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch

from harness.generation.client import GenerationClient
from harness.generation.client_thread import ClientThread
from harness.generation.protocol import Completion, SamplingConfig, ServerRequestError
from harness.generation.server_load import ServerLoad, parse_prometheus
from harness.server.app import EmbeddedServer
from harness.server.state import ServerConfig, ServerState
from harness.testing import build_tiny_qwen3, build_tiny_tokenizer
from harness.weight_sync.strategies import MergedWeightSync
from harness.weight_sync.transports import BroadcastTransfer, FileTransfer

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
MAX_MODEL_LEN = 256
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 61)), [3], [700, 800, 900, 1000]]


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return build_tiny_qwen3()


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(
        model="tiny-qwen3",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        kv_cache_tokens=32 * MAX_MODEL_LEN,
        enable_lora=True,
    )
    state = ServerState.from_model(build_tiny_qwen3(), config, tokenizer=build_tiny_tokenizer())
    with EmbeddedServer(state) as embedded:
        yield embedded


def run(fn, *args: Any) -> Any:
    return anyio.run(fn, *args)


def client_for(server: EmbeddedServer, **kwargs: Any) -> GenerationClient:
    return GenerationClient(server.base_url, timeout_s=60, max_concurrency=64, retry_backoff_s=0.01, **kwargs)


async def post_json(server: EmbeddedServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.base_url + path, json=body) as response,
    ):
        return response.status, await response.json()


async def metrics_load(server: EmbeddedServer) -> tuple[ServerLoad, dict[str, float]]:
    async with aiohttp.ClientSession() as session, session.get(server.base_url + "/metrics") as response:
        text = await response.text()
    flat = {}
    for sample in parse_prometheus(text):
        key = sample.name + (
            f"[{sample.labels['finished_reason']}]" if "finished_reason" in sample.labels else ""
        )
        flat[key] = sample.value
    return ServerLoad.from_text(text), flat


def processed_logprobs(
    model: torch.nn.Module, tokens: list[int], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """[len(tokens), V] log-probs of the next token at every position, after temperature / top-k / top-p."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    rows = []
    for row in logits:
        row = row / (1.0 if temperature < 1e-5 else temperature)
        if top_k > 0:
            kth = row.topk(top_k).values[-1]
            row = row.masked_fill(row < kth, -math.inf)
        if top_p < 1.0:
            probs = row.softmax(-1)
            order = probs.argsort(descending=True)
            keep = torch.zeros_like(row, dtype=torch.bool)
            mass = 0.0
            for token in order.tolist():
                keep[token] = True
                mass += probs[token].item()
                if mass >= top_p:
                    break
            row = row.masked_fill(~keep, -math.inf)
        rows.append(row.log_softmax(-1))
    return torch.stack(rows)


def assert_matches_forward(
    model, prompt: list[int], completion: Completion, **processing: Any
) -> torch.Tensor:
    expected = processed_logprobs(model, prompt + completion.output_ids, **processing)
    for j, token in enumerate(completion.output_ids):
        assert completion.output_log_probs[j] == pytest.approx(
            expected[len(prompt) - 1 + j, token].item(), abs=1e-4
        )
    return expected


# ---------------------------------------------------------------------- generation contract


def test_greedy_tokens_and_logprobs_equal_a_direct_forward(server, reference):
    async def main() -> list[Completion]:
        async with client_for(server) as client:
            return [await client.generate(p, SamplingConfig(max_tokens=12, temperature=0.0)) for p in PROMPTS]

    for prompt, completion in zip(PROMPTS, run(main), strict=True):
        expected = assert_matches_forward(reference, prompt, completion)
        argmax = expected[len(prompt) - 1 :].argmax(-1).tolist()
        assert completion.output_ids == argmax[: len(completion.output_ids)]


def test_concurrent_requests_share_batches_and_still_match(server, reference):
    """Different lengths decoded together (continuous batching) give each request its solo answer."""

    async def main() -> list[Completion]:
        results: list[Completion | None] = [None] * len(PROMPTS)
        async with client_for(server) as client:

            async def one(i: int) -> None:
                results[i] = await client.generate(PROMPTS[i], SamplingConfig(max_tokens=20, temperature=0.0))

            async with anyio.create_task_group() as tasks:
                for i in range(len(PROMPTS)):
                    tasks.start_soon(one, i)
        return results  # type: ignore[return-value]

    for prompt, completion in zip(PROMPTS, run(main), strict=True):
        assert_matches_forward(reference, prompt, completion)


def test_sampled_logprobs_are_processed_and_top_k_is_consistent(server, reference):
    sampling = SamplingConfig(max_tokens=24, temperature=0.7, top_k=40, top_p=0.9, num_logprobs=5)
    prompt = PROMPTS[2]

    async def main() -> Completion:
        async with client_for(server) as client:
            return await client.generate(prompt, sampling)

    completion = run(main)
    expected = assert_matches_forward(reference, prompt, completion, temperature=0.7, top_k=40, top_p=0.9)
    assert completion.output_sampler_logprobs is not None
    for j, (token, top) in enumerate(
        zip(completion.output_ids, completion.output_sampler_logprobs, strict=True)
    ):
        position = expected[len(prompt) - 1 + j]
        assert math.isfinite(completion.output_log_probs[j])  # sampled from the candidate set
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        best = position.topk(5)
        assert values == pytest.approx(best.values.tolist(), abs=1e-4)
        rank = int((position > position[token]).sum())
        if rank < 5:
            assert top[token] == pytest.approx(completion.output_log_probs[j], abs=1e-6)


def test_same_seed_same_tokens(server):
    sampling = SamplingConfig(max_tokens=30, temperature=1.0, num_logprobs=0)

    async def main() -> list[Completion]:
        async with client_for(server) as client:
            return [await client.generate(PROMPTS[0], sampling, seed=seed) for seed in (7, 7, 8)]

    first, again, other = run(main)
    assert first.output_ids == again.output_ids and first.output_log_probs == again.output_log_probs
    assert first.output_ids != other.output_ids


def test_prompt_too_long_is_refused_with_400_and_the_client_caps_max_tokens(server, reference):
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 4))

    async def main() -> tuple[tuple[int, Any], Completion, Completion]:
        refused = await post_json(
            server, "/v1/completions", {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 10}
        )
        async with client_for(server) as client:
            capped = await client.generate(
                prompt, SamplingConfig(max_tokens=10, temperature=0.0, num_logprobs=0)
            )
            full = await client.generate(list(range(MAX_MODEL_LEN)), SamplingConfig(max_tokens=10))
        return refused, capped, full

    (status, body), capped, full = run(main)
    assert status == 400 and "maximum context length is 256" in body["error"]["message"]
    assert capped.finish_reason == "length" and capped.truncation_reason == "max_model_len"
    assert len(capped.output_ids) == 4
    assert full.finish_reason == "prompt_too_long"


def test_unknown_model_is_a_404(server):
    async def main() -> None:
        async with client_for(server) as client:
            await client.generate([1, 2], SamplingConfig(max_tokens=2), model="no-such-model")

    with pytest.raises(ServerRequestError) as raised:
        run(main)
    assert raised.value.status == 404


# ---------------------------------------------------------------------- JSON shapes against vLLM's


def test_completion_json_has_vllm_shape(server):
    fixture = json.loads((FIXTURES / "completion_token_ids_top_logprobs.json").read_text())
    request = {
        "model": "tiny-qwen3",
        "prompt": [5, 6, 7],
        "max_tokens": 3,
        "logprobs": 2,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "seed": 1,
    }
    status, body = run(post_json, server, "/v1/completions", request)
    assert status == 200
    assert set(body) == set(fixture)
    choice, expected_choice = body["choices"][0], fixture["choices"][0]
    assert set(choice) == set(expected_choice)
    assert set(choice["logprobs"]) == set(expected_choice["logprobs"])
    assert set(body["usage"]) == set(fixture["usage"])
    assert (
        choice["prompt_token_ids"] == [5, 6, 7]
        and len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    )
    sampled = choice["logprobs"]["tokens"]
    for token, top in zip(sampled, choice["logprobs"]["top_logprobs"], strict=True):
        assert (
            token.startswith("token_id:") and next(iter(top)) == token
        )  # vLLM lists the sampled token first
        assert len(top) in (2, 3)


def test_models_json_has_vllm_shape(server):
    fixture = json.loads((FIXTURES / "models.json").read_text())

    async def main() -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.get(server.base_url + "/v1/models") as response,
        ):
            return await response.json()

    body = run(main)
    assert set(body) == set(fixture)
    card = body["data"][0]
    assert set(card) == set(fixture["data"][0])
    assert (card["id"], card["max_model_len"]) == ("tiny-qwen3", MAX_MODEL_LEN)


def test_metrics_parse_with_vllm_names(server):
    load, flat = run(metrics_load, server)
    vllm_names = {s.name for s in parse_prometheus((FIXTURES / "metrics_dp2.txt").read_text())}
    ours = {name.split("[")[0] for name in flat}
    wanted = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    }
    assert wanted <= ours and wanted <= vllm_names
    assert load.kv_cache_tokens == 32 * MAX_MODEL_LEN
    assert load.kv_cache_usage is not None and 0.0 <= load.kv_cache_usage <= 1.0


def test_metrics_time_each_generation_request_over_http(server):
    async def flow() -> list:
        status, _ = await post_json(
            server, "/v1/completions", {"model": "tiny-qwen3", "prompt": [5, 6, 7], "max_tokens": 4}
        )
        assert status == 200
        async with aiohttp.ClientSession() as session, session.get(server.base_url + "/metrics") as response:
            return parse_prometheus(await response.text())

    before = {(s.name, s.labels.get("handler")): s.value for s in run(flow)}
    after = {(s.name, s.labels.get("handler")): s.value for s in run(flow)}
    key = ("http_request_duration_seconds_count", "/v1/completions")
    assert after[key] == before[key] + 1
    generate = ("http_request_duration_seconds_count", "/inference/v1/generate")
    assert after[generate] == before[generate]  # each route counts its own requests only
    assert after[("http_request_duration_seconds_sum", "/v1/completions")] > 0
    # the handler's time holds the engine's time of the same request
    http_s = after[("http_request_duration_seconds_sum", "/v1/completions")]
    http_s -= before[("http_request_duration_seconds_sum", "/v1/completions")]
    e2e_s = after[("vllm:e2e_request_latency_seconds_sum", None)]
    e2e_s -= before[("vllm:e2e_request_latency_seconds_sum", None)]
    assert 0 < e2e_s <= http_s


# ---------------------------------------------------------------------- pause, abandon


async def _wait_for(server: EmbeddedServer, predicate, timeout_s: float = 10.0) -> dict[str, float]:
    with anyio.fail_after(timeout_s):
        while True:
            _, flat = await metrics_load(server)
            if predicate(flat):
                return flat
            await anyio.sleep(0.02)


def test_pause_keep_freezes_in_flight_requests_and_resume_continues(server):
    body = {
        "model": "tiny-qwen3",
        "prompt": [1, 2, 3],
        "max_tokens": 200,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def main() -> tuple[float, float, dict[str, Any]]:
        result: dict[str, Any] = {}

        async def request() -> None:
            result["status"], result["body"] = await post_json(server, "/v1/completions", body)

        async with client_for(server) as client, anyio.create_task_group() as tasks:
            tasks.start_soon(request)
            await _wait_for(server, lambda m: m["vllm:num_requests_running"] == 1)
            await client.pause("keep")
            assert await client.is_paused()
            _, before = await metrics_load(server)
            await anyio.sleep(0.3)
            _, after = await metrics_load(server)
            await client.resume()
        return before["vllm:generation_tokens_total"], after["vllm:generation_tokens_total"], result

    before, after, result = run(main)
    assert before == after  # frozen while paused
    assert result["status"] == 200
    choice = result["body"]["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 200  # continued, not aborted


def test_an_abandoned_request_frees_its_row(server):
    body = {"model": "tiny-qwen3", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}

    async def main() -> tuple[dict[str, float], dict[str, float]]:
        async with client_for(server) as client:
            _, start = await metrics_load(server)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(post_json, server, "/v1/completions", body)
                await _wait_for(server, lambda m: m["vllm:num_requests_running"] == 1)
                await client.pause("keep")  # frozen in its row: only the disconnect can free it
                tasks.cancel_scope.cancel()  # the client gives up and closes its connection
            freed = await _wait_for(server, lambda m: m["vllm:num_requests_running"] == 0)
            await client.resume()
        return start, freed

    start, freed = run(main)
    assert freed["vllm:request_success_total[abort]"] == start["vllm:request_success_total[abort]"] + 1


# ---------------------------------------------------------------------- weight updates


def _greedy(server: EmbeddedServer, prompt: list[int]) -> Completion:
    async def main() -> Completion:
        async with client_for(server) as client:
            return await client.generate(
                prompt, SamplingConfig(max_tokens=10, temperature=0.0, num_logprobs=0)
            )

    return run(main)


def test_weight_update_through_shared_memory_gives_the_new_weights_logprobs(server, reference, tmp_path):
    new_model = build_tiny_qwen3(seed=1)
    _, before = run(metrics_load, server)
    with ClientThread(server.base_url, 60) as client:
        sync = MergedWeightSync(FileTransfer(tmp_path), client)
        sync.sync(new_model, 1)
        try:
            assert not client.call("is_paused")
            assert list(tmp_path.iterdir()) == []  # the transfer file is gone
            assert_matches_forward(new_model, PROMPTS[0], _greedy(server, PROMPTS[0]))
            _, after = run(metrics_load, server)
            assert after["harness:weight_version"] == before["harness:weight_version"] + 1
        finally:
            sync.sync(reference, 2)
    assert_matches_forward(reference, PROMPTS[0], _greedy(server, PROMPTS[0]))


def test_a_bad_manifest_is_refused_changes_nothing_and_the_server_resumes(server, reference, tmp_path):
    bad = types.SimpleNamespace(
        named_parameters=lambda: iter([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    )
    with ClientThread(server.base_url, 60) as client:
        with pytest.raises(ServerRequestError, match="shape"):
            MergedWeightSync(FileTransfer(tmp_path), client).sync(bad, 1)
        assert not client.call("is_paused")
    assert list(tmp_path.iterdir()) == []
    assert_matches_forward(reference, PROMPTS[1], _greedy(server, PROMPTS[1]))


def test_weight_update_through_a_broadcast_group(server, reference):
    """The NCCL path's protocol, run with gloo on CPU: the group formed once, then two syncs over it."""
    new_model = build_tiny_qwen3(seed=2)
    with ClientThread(server.base_url, 60) as client:
        # A small buffer so the tensors travel in several buckets.
        transfer = BroadcastTransfer(device="cpu", buffer_size_bytes=20_000)
        transfer.connect(client, server.base_url)
        with MergedWeightSync(transfer, client) as sync:
            sync.sync(new_model, 1)
            assert_matches_forward(new_model, PROMPTS[3], _greedy(server, PROMPTS[3]))
            sync.sync(reference, 2)
    assert_matches_forward(reference, PROMPTS[3], _greedy(server, PROMPTS[3]))


# ---------------------------------------------------------------------- LoRA


def test_lora_adapter_serves_what_peft_computes(server, reference, tmp_path):
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(
        build_tiny_qwen3(),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, param in adapted.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would make the adapter a no-op
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    adapted.eval()
    adapted.save_pretrained(tmp_path / "adapter-v1")
    prompt = PROMPTS[0]
    sampling = SamplingConfig(max_tokens=8, temperature=0.0, num_logprobs=0)

    async def main() -> tuple[Completion, Completion]:
        async with client_for(server) as client:
            await client.load_lora_adapter("adapter-v1", tmp_path / "adapter-v1")
            with_adapter, base = await client.generate(prompt, sampling, model="adapter-v1"), None
            base = await client.generate(prompt, sampling)
            await client.unload_lora_adapter("adapter-v1")
            with pytest.raises(ServerRequestError):
                await client.generate(prompt, sampling, model="adapter-v1")
            return with_adapter, base

    with_adapter, base = run(main)
    assert_matches_forward(adapted, prompt, with_adapter)
    assert_matches_forward(reference, prompt, base)
    assert with_adapter.output_log_probs != base.output_log_probs

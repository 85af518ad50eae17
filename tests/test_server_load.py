"""Load on the built-in server: 256 concurrent requests on CPU with a tiny model, plus abandoned ones.

Checks that nothing is lost (every request answers, the server's counters agree), that the KV cache stays
within its budget and the process's memory within a bound, and that requests whose client gives up free
their rows.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from harness.generation.client import GenerationClient
from harness.generation.protocol import Completion, SamplingConfig
from harness.generation.server_load import parse_prometheus
from harness.server.app import EmbeddedServer
from harness.server.state import ServerConfig, ServerState
from harness.testing import build_tiny_qwen3

NUM_REQUESTS = 256
MAX_MODEL_LEN = 128
KV_CACHE_TOKENS = (
    128 * MAX_MODEL_LEN
)  # half of what 256 full-length requests would need: preemption can happen


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def counters(client: GenerationClient) -> dict[str, float]:
    text = await client._request("get", "/metrics")
    return {
        s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else ""): s.value
        for s in parse_prometheus(text)
    }


@pytest.mark.slow
def test_256_concurrent_requests_all_complete_within_bounded_memory():
    config = ServerConfig(
        model="tiny", max_model_len=MAX_MODEL_LEN, max_num_seqs=256, kv_cache_tokens=KV_CACHE_TOKENS
    )
    state = ServerState.from_model(build_tiny_qwen3(), config)
    results: list[Completion | None] = [None] * NUM_REQUESTS
    rss_before = rss_bytes()

    async def main() -> tuple[dict[str, float], dict[str, float]]:
        async with GenerationClient(server.base_url, timeout_s=120, max_concurrency=NUM_REQUESTS) as client:
            start = await counters(client)

            async def one(i: int) -> None:
                prompt = [(7 * i + j) % 1500 + 1 for j in range(8 + i % 24)]
                results[i] = await client.generate(
                    prompt, SamplingConfig(max_tokens=32 + i % 32, num_logprobs=2)
                )

            async with anyio.create_task_group() as tasks:
                for i in range(NUM_REQUESTS):
                    tasks.start_soon(one, i)
            return start, await counters(client)

    with EmbeddedServer(state) as server:
        start, end = anyio.run(main)
        allocated = state.engine.cache.allocated_bytes
        bytes_per_token = state.engine.cache.bytes_per_token
    rss_growth = rss_bytes() - rss_before

    assert all(r is not None for r in results)
    for i, completion in enumerate(results):
        assert completion is not None and 1 <= len(completion.output_ids) <= 32 + i % 32
        assert completion.finish_reason in ("stop", "length")
        assert len(completion.output_sampler_logprobs or []) == len(completion.output_ids)
    finished = sum(
        end[f"vllm:request_success_total[{r}]"] - start[f"vllm:request_success_total[{r}]"]
        for r in ("stop", "length")
    )
    assert finished == NUM_REQUESTS
    assert end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"] == sum(
        len(r.output_ids) for r in results if r is not None
    )
    assert end["vllm:num_requests_running"] == 0 and end["vllm:num_requests_waiting"] == 0
    assert allocated <= KV_CACHE_TOKENS * bytes_per_token
    assert rss_growth < 400 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"


def test_requests_the_client_abandons_free_their_rows():
    config = ServerConfig(
        model="tiny", max_model_len=MAX_MODEL_LEN, max_num_seqs=64, kv_cache_tokens=KV_CACHE_TOKENS
    )
    state = ServerState.from_model(build_tiny_qwen3(), config)

    async def main() -> tuple[dict[str, float], dict[str, float], list[Any]]:
        async with GenerationClient(server.base_url, timeout_s=60, max_concurrency=64) as client:
            start = await counters(client)
            await client.pause("keep")  # requests pile up in rows and queue; only disconnects free them
            with anyio.move_on_after(1.0):
                async with anyio.create_task_group() as tasks:
                    for i in range(48):
                        tasks.start_soon(client.generate, [i + 1, 2, 3], SamplingConfig(max_tokens=90))
            with anyio.fail_after(10):
                while (now := await counters(client))["vllm:num_requests_waiting"] + now[
                    "vllm:num_requests_running"
                ] > 0:
                    await anyio.sleep(0.02)
            await client.resume()
            after = await client.generate([1, 2, 3], SamplingConfig(max_tokens=5, num_logprobs=0))
            return start, await counters(client), [after]

    with EmbeddedServer(state) as server:
        start, end, (after,) = anyio.run(main)
    aborted = end["vllm:request_success_total[abort]"] - start["vllm:request_success_total[abort]"]
    assert aborted == 48
    assert after.output_ids  # the server still serves

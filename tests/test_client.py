"""GenerationClient against fixtures of real vLLM responses, served by a scripted HTTP double.

The double (`ScriptedServer`) answers each route from a queue of (status, body) replies and records the
requests it got, so tests can say "503 twice, then the fixture" and check what the client sent. Pure
parsing (Prometheus text, top-logprob keys) is tested on the fixtures directly.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web

from harness.generation.client import GenerationClient
from harness.generation.protocol import (
    Completion,
    ProtocolMismatchError,
    SamplingConfig,
    ServerRequestError,
    ServerUnavailableError,
    completion_top_entries,
    parse_top_logprobs,
)
from harness.generation.server_load import MetricsParseError, ServerLoad, parse_prometheus

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
Reply = tuple[int, Any]  # (status, JSON-able body or text)


def fixture_json(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


class ScriptedServer:
    """An HTTP server on a thread that replays scripted replies per path and records requests."""

    def __init__(self) -> None:
        self.replies: dict[str, deque[Reply]] = defaultdict(deque)
        self.defaults: dict[str, Reply] = {"/v1/models": (200, fixture_json("models.json"))}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.hold_until_in_flight = 0  # hold replies until this many requests are in flight (10 s at most)
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0

    def script(self, path: str, *replies: Reply) -> None:
        self.replies[path].extend(replies)

    def calls(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body in self.requests if p == path]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        self.requests.append((request.path, {**body, **dict(request.query)}))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for _ in range(1000 if request.path == "/v1/completions" else 0):
                if self.max_in_flight >= self.hold_until_in_flight:
                    break
                await asyncio.sleep(0.01)
        finally:
            self.in_flight -= 1
        queue = self.replies[request.path]
        status, reply = (
            queue.popleft() if queue else self.defaults.get(request.path, (404, {"detail": "Not Found"}))
        )
        if isinstance(reply, str):
            return web.Response(status=status, text=reply, content_type="text/plain")
        return web.json_response(reply, status=status)

    def __enter__(self) -> ScriptedServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)

        async def start() -> None:
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = self._runner.addresses[0][1]

        self._loop.run_until_complete(start())
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def double():
    with ScriptedServer() as server:
        yield server


def make_client(url: str, **kwargs: Any) -> GenerationClient:
    kwargs.setdefault("timeout_s", 10.0)
    kwargs.setdefault("retry_backoff_s", 0.001)
    kwargs.setdefault("retry_backoff_max_s", 0.005)
    return GenerationClient(url, **kwargs)


def run(coroutine_fn, *args: Any) -> Any:
    return anyio.run(coroutine_fn, *args)


SAMPLING = SamplingConfig(max_tokens=16, temperature=0.7, top_p=0.9, top_k=0, num_logprobs=2)


# ---------------------------------------------------------------------- pure parsing


def test_top_logprobs_become_sorted_id_dicts_of_the_k_most_likely():
    entries = [{"token_id:13": -2.5, "token_id:11": -0.4, "token_id:0": -1.6}, {"token_id:7": float("nan")}]
    assert parse_top_logprobs(completion_top_entries(entries), 2) == [{11: -0.4, 0: -1.6}, {}]
    assert list(parse_top_logprobs(completion_top_entries(entries), 3)[0]) == [11, 0, 13]
    with pytest.raises(ProtocolMismatchError, match="token_id"):
        completion_top_entries([{"Paris": -0.1}])


def test_metrics_of_two_engines_reduce_as_the_spec_says():
    load = ServerLoad.from_text((FIXTURES / "metrics_dp2.txt").read_text())
    assert load == ServerLoad(
        kv_cache_usage=0.8125,
        num_running=78,
        num_waiting=3,
        num_preemptions=17,
        kv_cache_tokens=2 * 11904 * 16,
    )
    assert load.to_metrics() == {
        "rollout/vllm_running_requests": 78.0,
        "rollout/vllm_queued_requests": 3.0,
        "rollout/vllm_preemption_count": 17.0,
        "rollout/vllm_kv_cache_usage_frac": 0.8125,
    }


def test_the_builtin_servers_prefix_cache_counters_are_read():
    from harness.server.engine import EngineStats
    from harness.server.metrics import render_metrics

    stats = EngineStats(num_prefix_cache_queries=1200, num_prefix_cache_hits=900, kv_cache_tokens=4096)
    load = ServerLoad.from_text(render_metrics(stats, model_name="m", max_model_len=512))
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (1200, 900)
    # A dump without the counters (this vLLM fixture) leaves them unknown rather than zero.
    legacy = ServerLoad.from_text((FIXTURES / "metrics_legacy.txt").read_text())
    assert legacy.prefix_cache_queries is None and legacy.prefix_cache_hits is None


def test_metrics_of_an_older_vllm_use_gpu_cache_usage():
    load = ServerLoad.from_text((FIXTURES / "metrics_legacy.txt").read_text())
    assert load == ServerLoad(
        kv_cache_usage=0.25, num_running=4, num_waiting=1, num_preemptions=2, kv_cache_tokens=2048 * 16
    )


def test_prometheus_parser_reads_labels_with_escapes_and_rejects_garbage():
    samples = parse_prometheus('m{a="x\\"y",b="1,2"} 3.5 1700000000\n# comment\n\nn 1e3\n')
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("m", {"a": 'x"y', "b": "1,2"}, 3.5),
        ("n", {}, 1000.0),
    ]
    with pytest.raises(MetricsParseError):
        parse_prometheus("this is not prometheus")


def test_completion_becomes_a_turn_record():
    completion = Completion(
        output_ids=[5, 6],
        output_log_probs=[-0.1, -0.2],
        output_sampler_logprobs=[{5: -0.1}, {6: -0.2}],
        finish_reason="stop",
    )
    turn = completion.to_turn_record([1, 2, 3])
    assert (turn.prompt_ids, turn.output_ids, turn.output_log_probs) == ([1, 2, 3], [5, 6], [-0.1, -0.2])
    assert turn.output_sampler_logprobs == [{5: -0.1}, {6: -0.2}]
    assert not completion.truncated


# ---------------------------------------------------------------------- against the double


def test_generate_parses_the_vllm_fixture_and_sends_vllm_fields(double):
    double.script("/v1/completions", (200, fixture_json("completion_token_ids_top_logprobs.json")))

    async def main() -> Completion:
        async with make_client(double.url) as client:
            return await client.generate([785, 6722, 315, 9625, 374], SAMPLING)

    completion = run(main)
    assert completion.output_ids == [12095, 13, 151645]
    assert completion.output_log_probs == [-0.0312, -2.4421, -0.0007]
    # The sampled token 13 ranked outside the top 2: vLLM lists it, the client keeps only the top 2.
    assert completion.output_sampler_logprobs == [
        {12095: -0.0312, 279: -3.6021},
        {11: -0.4473, 0: -1.6115},
        {151645: -0.0007, 198: -7.9063},
    ]
    assert completion.finish_reason == "stop" and completion.truncation_reason is None
    (sent,) = double.calls("/v1/completions")
    assert sent["prompt"] == [785, 6722, 315, 9625, 374]
    assert sent["model"] == "Qwen/Qwen3-0.6B"  # from /v1/models
    assert sent["return_token_ids"] is True and sent["return_tokens_as_token_ids"] is True
    assert (sent["logprobs"], sent["top_k"], sent["top_p"], sent["temperature"]) == (2, -1, 0.9, 0.7)
    assert (sent["max_tokens"], sent["n"], sent["min_p"], sent["repetition_penalty"]) == (16, 1, 0.0, 1.0)
    assert isinstance(sent["seed"], int)


def test_each_request_gets_a_fresh_seed(double):
    reply = (200, fixture_json("completion_token_ids_top_logprobs.json"))
    double.script("/v1/completions", reply, reply, reply)

    async def main() -> None:
        async with make_client(double.url) as client:
            for _ in range(3):
                await client.generate([1, 2], SAMPLING)

    run(main)
    seeds = [call["seed"] for call in double.calls("/v1/completions")]
    assert len(set(seeds)) == 3


def test_transient_errors_are_retried_and_counted(double):
    fixture = fixture_json("completion_token_ids_top_logprobs.json")
    aborted = json.loads(json.dumps(fixture))
    aborted["choices"][0]["finish_reason"] = "abort"
    double.script(
        "/v1/completions",
        (503, {"error": {"message": "overloaded", "type": "ServiceUnavailable", "code": 503}}),
        (500, {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}),
        (200, aborted),
        (200, fixture),
    )

    async def main() -> tuple[Completion, dict[str, float], dict[str, float]]:
        async with make_client(double.url) as client:
            completion = await client.generate([1, 2, 3], SAMPLING)
            return completion, client.pop_metrics(), client.pop_metrics()

    completion, first, second = run(main)
    assert completion.output_ids == [12095, 13, 151645]
    assert first["rollout/vllm_retry_count"] == 3.0
    assert second == {"rollout/vllm_retry_count": 0.0}
    seeds = {call["seed"] for call in double.calls("/v1/completions")}
    assert len(seeds) == 1  # a retry repeats the same request


def test_retries_give_up_with_a_typed_error(double):
    double.script("/v1/completions", *[(502, {"error": {"message": "bad gateway"}})] * 3)

    async def main() -> None:
        async with make_client(double.url, max_retries=2) as client:
            await client.generate([1], SAMPLING)

    with pytest.raises(ServerUnavailableError, match="after 3 attempts"):
        run(main)
    assert len(double.calls("/v1/completions")) == 3


def test_a_4xx_is_never_retried(double):
    double.script("/v1/completions", (404, fixture_json("error_unknown_model.json")))

    async def main() -> None:
        async with make_client(double.url) as client:
            await client.generate([1], SAMPLING, model="no-such-model")

    with pytest.raises(ServerRequestError) as raised:
        run(main)
    assert raised.value.status == 404 and "does not exist" in raised.value.message
    assert len(double.calls("/v1/completions")) == 1


def test_prompt_too_long_rejection_is_a_truncated_outcome_not_an_error(double):
    double.defaults["/v1/models"] = (200, {"object": "list", "data": [{"id": "m"}]})  # no max_model_len
    double.script("/v1/completions", (400, fixture_json("error_prompt_too_long.json")))

    async def main() -> Completion:
        async with make_client(double.url) as client:
            return await client.generate(list(range(3000)), SamplingConfig(max_tokens=2048))

    completion = run(main)
    assert completion.finish_reason == "prompt_too_long" and completion.truncated
    assert completion.output_ids == [] and "maximum context length is 4096" in completion.truncation_reason
    assert len(double.calls("/v1/completions")) == 1


def test_max_tokens_is_capped_at_max_model_len_and_full_prompts_are_not_sent(double):
    double.script("/v1/completions", (200, fixture_json("completion_token_ids_top_logprobs.json")))

    async def main() -> tuple[Completion, Completion]:
        async with make_client(double.url) as client:  # max_model_len 4096 (models.json)
            capped = await client.generate(list(range(4093)), SamplingConfig(max_tokens=100, num_logprobs=2))
            full = await client.generate(list(range(4096)), SamplingConfig(max_tokens=100))
            return capped, full

    capped, full = run(main)
    (sent,) = double.calls("/v1/completions")
    assert sent["max_tokens"] == 3
    assert capped.finish_reason == "stop"  # the fixture's: the turn ended on its own within the cap
    assert full.finish_reason == "prompt_too_long" and "4096" in full.truncation_reason


def test_length_finish_says_whether_max_tokens_or_max_model_len_cut_it(double):
    fixture = fixture_json("completion_token_ids_top_logprobs.json")
    fixture["choices"][0]["finish_reason"] = "length"
    double.script("/v1/completions", (200, fixture), (200, fixture))

    async def main() -> tuple[Completion, Completion]:
        async with make_client(double.url) as client:
            by_max_tokens = await client.generate([1, 2], SamplingConfig(max_tokens=3, num_logprobs=0))
            by_context = await client.generate(
                list(range(4093)), SamplingConfig(max_tokens=50, num_logprobs=0)
            )
            return by_max_tokens, by_context

    by_max_tokens, by_context = run(main)
    assert (by_max_tokens.truncation_reason, by_context.truncation_reason) == ("max_tokens", "max_model_len")
    assert by_max_tokens.output_sampler_logprobs is None  # num_logprobs=0: sampled tokens only


def test_a_server_without_token_ids_is_a_protocol_mismatch(double):
    fixture = fixture_json("completion_token_ids_top_logprobs.json")
    del fixture["choices"][0]["token_ids"]
    double.script("/v1/completions", (200, fixture))

    async def main() -> None:
        async with make_client(double.url) as client:
            await client.generate([1], SAMPLING)

    with pytest.raises(ProtocolMismatchError, match="return_token_ids"):
        run(main)


def test_connection_pool_is_sized_to_the_concurrency(double):
    """150 requests in flight reach the server at once (a default pool would hold them at 100)."""
    double.hold_until_in_flight = 150
    fixture = fixture_json("completion_token_ids_top_logprobs.json")
    double.script("/v1/completions", *[(200, fixture)] * 150)

    async def main() -> None:
        async with make_client(double.url, max_concurrency=150) as client:
            await client.model_info()
            async with anyio.create_task_group() as tasks:
                for _ in range(150):
                    tasks.start_soon(client.generate, [1], SAMPLING)

    run(main)
    assert double.max_in_flight == 150


def test_metrics_polling_and_missing_metrics(double):
    double.script(
        "/metrics", (200, (FIXTURES / "metrics_dp2.txt").read_text()), (404, {"detail": "Not Found"})
    )

    async def main() -> tuple[ServerLoad | None, ServerLoad | None]:
        async with make_client(double.url) as client:
            return await client.server_load(), await client.server_load()

    load, missing = run(main)
    assert load is not None and load.num_running == 78
    assert missing is None


def test_control_calls_hit_vllm_routes(double):
    double.script("/pause", (200, {"status": "paused"}))
    double.script("/resume", (200, {"status": "resumed"}))
    double.script("/is_paused", (200, {"is_paused": False}))
    double.script("/v1/load_lora_adapter", (200, "Success"))
    double.script("/v1/unload_lora_adapter", (200, "Success"))
    double.script("/health", (503, {}), (200, ""))

    async def main() -> bool:
        async with make_client(double.url) as client:
            await client.wait_until_ready(timeout_s=5, poll_interval_s=0.01)
            await client.pause()
            await client.resume()
            await client.load_lora_adapter("v1", "/tmp/adapter-v1")
            await client.unload_lora_adapter("v1")
            return await client.is_paused()

    assert run(main) is False
    assert double.calls("/pause") == [{"mode": "keep"}]
    assert double.calls("/v1/load_lora_adapter") == [
        {"lora_name": "v1", "lora_path": "/tmp/adapter-v1", "load_inplace": False}
    ]
    assert double.calls("/v1/unload_lora_adapter") == [{"lora_name": "v1"}]
    assert len(double.calls("/health")) == 2


def test_the_weight_transfer_group_calls_hit_vllm_routes(double):
    double.script("/get_world_size", (200, {"world_size": 2}))
    double.script("/init_weight_transfer_engine", (200, {}))

    async def main() -> int:
        async with make_client(double.url) as client:
            await client.init_weight_transfer_engine({"world_size": 3})
            return await client.get_world_size()

    assert run(main) == 2
    assert double.calls("/init_weight_transfer_engine") == [{"init_info": {"world_size": 3}}]
    assert len(double.calls("/get_world_size")) == 1


def test_waiting_for_a_server_that_never_comes_up_times_out():
    async def main() -> None:
        # Port 9 (discard) on loopback: nothing listens there, so every poll is refused.
        async with make_client("http://127.0.0.1:9") as client:
            await client.wait_until_ready(timeout_s=0.3, poll_interval_s=0.05)

    with pytest.raises(ServerUnavailableError, match="not ready in time"):
        run(main)


def test_the_worker_logs_the_prefix_cache_hit_share_of_each_poll_interval():
    from types import SimpleNamespace

    from harness.metrics import MetricsWindow
    from harness.rollout.loop import AsyncRolloutLoop

    counters = iter([(1000, 600), (1000, 600), (3000, 2400)])  # cumulative (queries, hits) per poll

    class Client:
        async def server_load(self) -> ServerLoad:
            queries, hits = next(counters)
            return ServerLoad(0.5, 4, 0, 0, 4096, prefix_cache_queries=queries, prefix_cache_hits=hits)

    loop = SimpleNamespace(
        client=Client(),
        cap=SimpleNamespace(update=lambda load: None, value=8),
        rollout_slots=SimpleNamespace(total_tokens=8),
        window=MetricsWindow(),
    )
    shares = []
    for _ in range(3):
        run(AsyncRolloutLoop._poll_server, loop)
        shares.append(loop.window.summary().get("rollout/vllm_prefix_cache_hit_frac"))
        loop.window.reset()
    # 600 of 1000 tokens, then no new prompt tokens (nothing logged), then 1800 of the next 2000.
    assert shares == [pytest.approx(0.6), None, pytest.approx(0.9)]

"""`harness serve --api-server-count N`: HTTP in processes beside the engine's (`api_servers.py`).

Each test runs the real command in a subprocess on a tiny model folder. What must hold: the answers are
the ones the engine's own HTTP gives (tokens, log-probs, errors), every other route reaches the engine
through the proxy (adapters loaded there serve requests from every API server), an abandoned request frees
its row, and no process outlives the server whichever side dies first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from harness.generation.client import GenerationClient
from harness.generation.protocol import Completion, SamplingConfig
from harness.generation.server_load import parse_prometheus
from harness.server.launch import BuiltinServer, start_builtin_server
from harness.server.state import ServerConfig
from harness.testing import build_tiny_qwen3

pytestmark = pytest.mark.slow

PROMPTS = [[(5 * i + j) % 1000 + 3 for j in range(4 + i % 9)] for i in range(24)]


def serve(model_dir: str, count: int, log_path: Any, *extra: str) -> BuiltinServer:
    return start_builtin_server(
        model_dir,
        device="cpu",
        num_threads=1,
        extra_args=["--api-server-count", str(count), "--enable-lora", *extra],
        log_path=log_path,
    )


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[int, BuiltinServer]]:
    logs = tmp_path_factory.mktemp("api-server-logs")
    started = {count: serve(tiny_model_dir, count, logs / f"serve-{count}.log") for count in (0, 2)}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


def post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Status and body (parsed when JSON)."""
    request = urllib.request.Request(
        base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            status, raw, kind = answer.status, answer.read(), answer.headers.get_content_type()
    except urllib.error.HTTPError as error:
        status, raw, kind = error.code, error.read(), error.headers.get_content_type()
    return status, json.loads(raw) if kind == "application/json" else raw.decode()


def get(base_url: str, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(base_url + path, timeout=60) as answer:
        return answer.status, answer.read()


def counters(base_url: str) -> dict[str, float]:
    return {
        s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else ""): s.value
        for s in parse_prometheus(get(base_url, "/metrics")[1].decode())
    }


def generate_all(base_url: str, model: str | None = None) -> list[Completion]:
    """Every prompt at once (greedy ones and seeded samples), through the client the trainer uses."""

    async def main() -> list[Completion]:
        results: list[Completion | None] = [None] * len(PROMPTS)
        async with GenerationClient(base_url, timeout_s=120, max_concurrency=len(PROMPTS)) as client:

            async def one(i: int) -> None:
                sampling = SamplingConfig(
                    max_tokens=6 + i % 7, temperature=0.0 if i % 2 else 1.0, num_logprobs=2
                )
                results[i] = await client.generate(PROMPTS[i], sampling, model=model, seed=i)

            async with anyio.create_task_group() as tasks:
                for i in range(len(PROMPTS)):
                    tasks.start_soon(one, i)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    return anyio.run(main)


def assert_same(ours: list[Completion], theirs: list[Completion]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-4)
        for ours_top, theirs_top in zip(
            a.output_sampler_logprobs or [], b.output_sampler_logprobs or [], strict=True
        ):
            assert ours_top == pytest.approx(theirs_top, abs=1e-4)


def test_api_servers_answer_what_the_engines_own_http_answers(servers):
    in_process = generate_all(servers[0].base_url)
    fronted = generate_all(servers[2].base_url)
    assert_same(fronted, in_process)
    assert any(len(c.output_ids) > 1 for c in fronted)


def test_text_prompts_and_every_kind_of_error_pass_through(servers, tiny_model_dir):
    answers = {}
    for count, server in servers.items():
        ok = post(
            server.base_url,
            "/v1/completions",
            {
                "model": tiny_model_dir,
                "prompt": "hello there",
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 1,
            },
        )
        unknown = post(
            server.base_url, "/v1/completions", {"model": "nope", "prompt": [1, 2], "max_tokens": 2}
        )
        invalid = post(server.base_url, "/v1/completions", {"prompt": [1, 2], "max_tokens": -3})
        too_long = post(
            server.base_url,
            "/inference/v1/generate",
            {"token_ids": [5] * 5000, "sampling_params": {"max_tokens": 2}},
        )
        answers[count] = (ok, unknown, invalid, too_long)
    ok, unknown, invalid, too_long = answers[2]
    assert ok[0] == 200 and ok[1]["choices"][0]["text"]
    assert unknown[0] == 404 and "`nope` does not exist" in unknown[1]["error"]["message"]
    assert invalid[0] == 400 and invalid[1]["error"]["param"] == "max_tokens"
    assert too_long[0] == 400
    for fronted, in_process in zip(answers[2], answers[0], strict=True):
        assert fronted[0] == in_process[0]
        if fronted[0] != 200:
            assert fronted[1]["error"] == in_process[1]["error"]
    assert ok[1]["choices"][0]["text"] == answers[0][0][1]["choices"][0]["text"]


def test_control_routes_reach_the_engine_and_adapters_serve_from_every_api_server(servers, tmp_path):
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(
        build_tiny_qwen3(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would make the adapter a no-op
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    adapted.save_pretrained(tmp_path / "adapter")
    url = servers[2].base_url
    assert get(url, "/health")[0] == 200
    before = counters(url)
    for server in servers.values():
        status, _ = post(
            server.base_url,
            "/v1/load_lora_adapter",
            {"lora_name": "adapted", "lora_path": str(tmp_path / "adapter")},
        )
        assert status == 200
    models = json.loads(get(url, "/v1/models")[1])
    assert [card["id"] for card in models["data"]][1:] == ["adapted"]
    with_adapter = generate_all(url, model="adapted")
    assert_same(with_adapter, generate_all(servers[0].base_url, model="adapted"))
    assert [c.output_ids for c in with_adapter] != [c.output_ids for c in generate_all(url)]
    after = counters(url)
    assert after["vllm:request_success_total[stop]"] + after["vllm:request_success_total[length]"] - (
        before["vllm:request_success_total[stop]"] + before["vllm:request_success_total[length]"]
    ) == 2 * len(PROMPTS)
    for server in servers.values():
        assert post(server.base_url, "/v1/unload_lora_adapter", {"lora_name": "adapted"})[0] == 200
    assert post(url, "/pause?mode=keep", {})[0] == 200
    assert json.loads(get(url, "/is_paused")[1]) == {"is_paused": True}
    assert post(url, "/resume", {})[0] == 200
    assert json.loads(get(url, "/is_paused")[1]) == {"is_paused": False}


def test_a_request_whose_client_leaves_frees_its_row(servers):
    url = servers[2].base_url
    start = counters(url)

    async def main() -> Completion:
        async with GenerationClient(url, timeout_s=60, max_concurrency=16) as client:
            await client.pause("keep")  # requests wait in the engine; only a disconnect ends them
            with anyio.move_on_after(1.0):
                async with anyio.create_task_group() as tasks:
                    for i in range(12):
                        tasks.start_soon(client.generate, [i + 1, 2, 3], SamplingConfig(max_tokens=90))
            with anyio.fail_after(15):
                while (now := counters(url))["vllm:num_requests_waiting"] + now["vllm:num_requests_running"]:
                    await anyio.sleep(0.05)
            await client.resume()
            return await client.generate([1, 2, 3], SamplingConfig(max_tokens=4, num_logprobs=0))

    after = anyio.run(main)
    end = counters(url)
    assert end["vllm:request_success_total[abort]"] - start["vllm:request_success_total[abort]"] == 12
    assert after.output_ids


def children(pid: int) -> list[int]:
    listed = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(word) for word in listed.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
        return stat.read().split(")")[-1].split()[0] != "Z"


def wait_until(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_killing_the_engine_process_ends_its_api_servers(tiny_model_dir, tmp_path):
    server = serve(tiny_model_dir, 2, tmp_path / "serve.log")
    try:
        fronts = children(server.pid)
        assert len(fronts) >= 2  # two API servers (and multiprocessing's resource tracker)
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in fronts), 15), [p for p in fronts if alive(p)]
    finally:
        server.stop()


def test_an_api_server_that_dies_stops_the_whole_server(tiny_model_dir, tmp_path):
    server = serve(tiny_model_dir, 2, tmp_path / "serve.log")
    try:
        fronts = children(server.pid)
        front = next(pid for pid in fronts if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(front, signal.SIGKILL)
        assert server.process.wait(timeout=30) != 0
        assert wait_until(lambda: not any(alive(pid) for pid in fronts), 15)
        assert "exited" in (tmp_path / "serve.log").read_text()
    finally:
        server.stop()


def test_sigterm_stops_the_server_and_its_api_servers_cleanly(tiny_model_dir, tmp_path):
    server = serve(tiny_model_dir, 2, tmp_path / "serve.log")
    fronts = children(server.pid)
    api_servers = [pid for pid in fronts if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(api_servers) == 2
    assert server.stop() == 0
    assert not any(alive(pid) for pid in api_servers)  # joined before the server exits
    # multiprocessing's resource tracker leaves once it reads its pipe's end
    assert wait_until(lambda: not any(alive(pid) for pid in fronts), 10)


def test_sigterm_to_every_process_at_once_is_a_clean_stop(tiny_model_dir, tmp_path):
    """As a terminal or a supervisor signals the process group: no API server counts as lost."""
    server = serve(tiny_model_dir, 2, tmp_path / "serve.log")
    fronts = children(server.pid)
    api_servers = [pid for pid in fronts if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    for pid in [*api_servers, server.pid]:
        os.kill(pid, signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in api_servers)
    assert "exited" not in (tmp_path / "serve.log").read_text()
    server.stop()


def test_a_negative_count_is_refused_with_its_name():
    with pytest.raises(ValueError, match="api_server_count must be 0 or more, got -1"):
        ServerConfig(model="m", api_server_count=-1)

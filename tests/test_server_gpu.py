"""The built-in server on a CUDA device: numerics against a direct forward, weight updates by file and NCCL.

Skipped without a GPU (conftest). The NCCL test needs two GPUs: the trainer's rank on cuda:0 and the
server on cuda:1, as NCCL refuses two ranks on one device.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from harness.generation.client import GenerationClient
from harness.generation.client_thread import ClientThread
from harness.generation.protocol import Completion, SamplingConfig
from harness.server.app import EmbeddedServer
from harness.server.fused_projections import ProjectionSlice
from harness.server.state import ServerConfig, ServerState
from harness.testing import build_tiny_qwen3
from harness.weight_sync.strategies import MergedWeightSync
from harness.weight_sync.transports import BroadcastTransfer, FileTransfer

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), [3]]


def serve_tiny(device: str, dtype: torch.dtype = torch.float32) -> EmbeddedServer:
    model = build_tiny_qwen3(dtype=dtype).to(device)
    config = ServerConfig(model="tiny", max_model_len=256, max_num_seqs=16, kv_cache_tokens=16 * 256)
    return EmbeddedServer(ServerState.from_model(model, config))


def greedy(url: str, prompts: list[list[int]], **kwargs) -> list[Completion]:
    async def main() -> list[Completion]:
        async with GenerationClient(url, timeout_s=120) as client:
            return [
                await client.generate(
                    p, SamplingConfig(max_tokens=16, temperature=0.0, num_logprobs=0), **kwargs
                )
                for p in prompts
            ]

    return anyio.run(main)


def assert_matches(model: torch.nn.Module, prompt: list[int], completion: Completion, atol: float) -> None:
    tokens = torch.tensor([prompt + completion.output_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logprobs = model(tokens).logits[0].float().log_softmax(-1)
    for j, token in enumerate(completion.output_ids):
        assert completion.output_log_probs[j] == pytest.approx(
            logprobs[len(prompt) - 1 + j, token].item(), abs=atol
        )


def test_cuda_server_matches_a_direct_forward():
    # On a GPU the server fuses q/k/v and gate/up by default (fused_projections.py): its graphs replay those.
    reference = build_tiny_qwen3().to("cuda")
    with serve_tiny("cuda") as server:
        assert isinstance(server.state.model.model.layers[0].self_attn.q_proj, ProjectionSlice)
        for prompt, completion in zip(PROMPTS, greedy(server.base_url, PROMPTS), strict=True):
            assert_matches(reference, prompt, completion, atol=1e-3)


def test_cuda_weight_update_through_shared_memory():
    new_model = build_tiny_qwen3(seed=3).to("cuda")
    with serve_tiny("cuda") as server:
        with ClientThread(server.base_url, 120) as client:
            MergedWeightSync(FileTransfer(), client).sync(new_model, 1)
        (completion,) = greedy(server.base_url, PROMPTS[:1])
    assert_matches(new_model, PROMPTS[0], completion, atol=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between trainer and server needs two GPUs")
def test_nccl_weight_update_between_two_gpus():
    new_model = build_tiny_qwen3(seed=4).to("cuda:0")
    with serve_tiny("cuda:1") as server:
        with ClientThread(server.base_url, 120) as client:
            transfer = BroadcastTransfer(device="cuda:0", buffer_size_bytes=50_000)
            transfer.connect(client, server.base_url)
            with MergedWeightSync(transfer, client) as sync:
                sync.sync(new_model, 1)
        (completion,) = greedy(server.base_url, PROMPTS[:1])
    assert_matches(new_model, PROMPTS[0], completion, atol=1e-3)


def test_cuda_ipc_weight_update_to_a_server_process(tmp_path):
    """The trainer's CUDA buffer opened by a built-in server process on the same GPU: after each sync the
    server generates exactly what the trainer's weights compute. A small buffer makes one sync several
    buckets; a hostile handle is refused without touching the served weights."""
    from harness.server.launch import start_builtin_server
    from harness.testing import build_tiny_tokenizer
    from harness.weight_sync.cuda_ipc import share_buffer
    from harness.weight_sync.plan import plan_weight_sync
    from harness.weight_sync.transports import IpcTransfer

    model_dir = tmp_path / "model"
    build_tiny_qwen3().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    with (
        start_builtin_server(model_dir, device="cuda", dtype="float32", max_model_len=256) as server,
        ClientThread(server.base_url, 120.0) as client,
    ):
        plan = plan_weight_sync(
            build_tiny_qwen3().to("cuda"), client.server_info(), base_url=server.base_url, max_staleness=1
        )
        assert plan.kind == "ipc"  # the server reports the trainer's GPU among those it sees
        sync = MergedWeightSync(IpcTransfer(device="cuda", buffer_size_bytes=64 << 10), client)
        for seed in (1, 2):
            model = build_tiny_qwen3(seed=seed).to("cuda")
            timings = sync.sync(model, seed)
            for prompt, completion in zip(PROMPTS, greedy(server.base_url, PROMPTS), strict=True):
                assert_matches(model, prompt, completion, atol=1e-3)
        print(f"ipc sync of the tiny model: {timings['perf/weight_sync_s'] * 1e3:.1f} ms")
        hostile = {
            "names": ["model.norm.weight"],
            "dtype_names": ["float32"],
            "shapes": [[64]],
            "ipc": {"buffer": {"args": [{"class": "Module"}] * 15}, "offsets": [0]},
        }
        with pytest.raises(Exception, match=r"may not|could not read"):
            client.call("send_weight_manifest", hostile)
        elsewhere = {
            **hostile,
            "ipc": {
                "buffer": {
                    **share_buffer(torch.zeros(256, dtype=torch.uint8, device="cuda")),
                    "device_uuid": "GPU-not-this-one",
                },
                "offsets": [0],
            },
        }
        with pytest.raises(Exception, match=r"not visible to this process"):
            client.call("send_weight_manifest", elsewhere)
        for prompt, completion in zip(PROMPTS, greedy(server.base_url, PROMPTS), strict=True):
            assert_matches(model, prompt, completion, atol=1e-3)  # still the last synced weights
        sync.close()

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
    reference = build_tiny_qwen3().to("cuda")
    with serve_tiny("cuda") as server:
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

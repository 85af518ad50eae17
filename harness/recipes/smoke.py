"""`harness smoke`: a quick end-to-end check of an installation on tiny offline models.

It exercises what every training run stands on, without a network or a GPU:

1. the offline tiny tokenizer and a tiny random Qwen3 model built from a config;
2. a tool-calling conversation rendered with the chat template and the tool's schema, and a check that
   each rendered turn extends the previous one token for token (prefix preservation);
3. sampling a reply from the model (random weights, so the text is noise);
4. the model's tool call executed by the tool executor (the call is scripted: a random model cannot call
   tools yet), and its result rendered back as a tool message;
5. a few optimizer steps on the assistant tokens of the conversation, which must lower the loss.

It exits non-zero if any check fails.
"""

from __future__ import annotations

import time
from typing import Any


def run_smoke(*, steps: int = 5, seed: int = 0) -> int:
    import anyio
    import torch

    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer
    from tools import ToolCall, ToolExecutor, Toolset
    from tools.calculator import calculator

    started = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_qwen3(seed=seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: tiny Qwen3, {num_params:,} parameters; tokenizer: {len(tokenizer):,} tokens")

    toolset = Toolset([calculator])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 * 23? Use the calculator."}]
    prompt_ids = render(tokenizer, messages, toolset, generation_prompt=True)
    print(f"prompt: {len(prompt_ids)} tokens with the schema of {toolset.names()}")

    generated = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=True, pad_token_id=tokenizer.pad_token_id
    )
    sample = tokenizer.decode(generated[0, len(prompt_ids) :], skip_special_tokens=False)
    print(f"sampled reply (random weights): {sample!r}")

    call = ToolCall("calculator", {"expression": "17 * 23"}, id="call_0")
    with ToolExecutor(max_workers=4, timeout_s=10.0) as executor:
        (result,) = anyio.run(executor.run, [call], toolset)
    print(f"tool call: calculator(expression='17 * 23') -> {result.status.value}: {result.content}")
    messages += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "name": call.name, "content": result.content},
        {"role": "assistant", "content": f"17 * 23 = {result.content}."},
    ]

    renders = [render(tokenizer, messages[:k], toolset) for k in range(1, len(messages) + 1)]
    preserving = all(renders[k] == renders[k + 1][: len(renders[k])] for k in range(len(renders) - 1))
    print(f"conversation: {len(renders[-1])} tokens; every turn extends the previous one: {preserving}")

    input_ids, labels = training_example(tokenizer, messages, toolset)
    losses = train_steps(model, input_ids, labels, steps=steps)
    print(
        f"training on {int((labels != -100).sum())} assistant tokens: loss "
        + " -> ".join(f"{x:.3f}" for x in losses)
    )

    checks = {
        "tool call succeeded": result.ok and result.content == "391",
        "template is prefix-preserving": preserving,
        "loss went down": losses[-1] < losses[0],
    }
    for name, passed in checks.items():
        print(f"[{'ok' if passed else 'FAILED'}] {name}")
    print(f"smoke run finished in {time.perf_counter() - started:.1f} s")
    return 0 if all(checks.values()) else 1


def render(
    tokenizer: Any, messages: list[dict[str, Any]], toolset: Any, *, generation_prompt: bool = False
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=toolset.schemas(), add_generation_prompt=generation_prompt, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def training_example(tokenizer: Any, messages: list[dict[str, Any]], toolset: Any) -> tuple[Any, Any]:
    """Token ids of the conversation, and labels that keep only the assistant turns' tokens."""
    import torch

    input_ids = torch.tensor(render(tokenizer, messages, toolset))
    labels = torch.full_like(input_ids, -100)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render(tokenizer, messages[:k], toolset, generation_prompt=True))
            end = len(render(tokenizer, messages[: k + 1], toolset))
            labels[start:end] = input_ids[start:end]
    return input_ids[None], labels[None]


def train_steps(model: Any, input_ids: Any, labels: Any, *, steps: int) -> list[float]:
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=labels).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        losses.append(model(input_ids=input_ids, labels=labels).loss.item())
    model.eval()
    return losses

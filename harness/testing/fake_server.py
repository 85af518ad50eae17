"""One in-process generation server for tests and benchmarks: `FakeGenerationServer`.

It implements both Protocols of harness/generation/protocol.py, so it stands in wherever a real server's
client goes: `AsyncRolloutLoop(..., client=fake)` samples from it, `ClientThread(client=fake)` gives a
weight sync its control calls. What it answers and records:

    fake = FakeGenerationServer(lambda text, call: "the reply", tokenizer=tokenizer)
    fake.generate(...)      the reply `respond(prompt, call_index)` gives: text (encoded, EOS appended),
                            token ids, a whole Completion, or None for a server failing after its retries
                            (GenerationError); `prompt` is the decoded text with a tokenizer, else the ids
    fake.calls              every control call that changes the server, in order, as the vLLM route and
                            body the HTTP client would send: [("/pause", "keep"), ("/update_weights",
                            update_info), ...] (reads such as get_world_size are not listed)
    fake.weights            the tensors file syncs delivered (read from the file before it is deleted)
    fake.adapters           loaded LoRA adapters, name -> path
    fake.before(name, hook) an async hook run before the method `name` answers, given its body (raise to
                            fail it, sleep to hang, wait on an event to model a server that waits
                            for the trainer)

Nothing here opens a socket: tests of the HTTP client itself run it against the real built-in server or a
scripted HTTP double (tests/test_client.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import anyio

from harness.generation.protocol import (
    Completion,
    GenerationError,
    ModelInfo,
    PauseMode,
    SamplingConfig,
)
from harness.generation.server_load import ServerLoad

Reply = str | Sequence[int] | Completion | None
Hook = Callable[..., Awaitable[None]]


class FakeGenerationServer:
    """A scripted generation server in this process (see the module docstring).

    Args:
        respond: `(prompt, call_index) -> Reply`, call_index counting generate calls from 1.
        tokenizer: Decodes prompts for `respond` and encodes text replies (its `<|im_end|>`, else its EOS,
            ends each reply); without one, `respond` gets token ids and must return ids or a Completion.
        model_id, max_model_len: What /v1/models would say.
        server_info: What /server_info would say ({"server": "agent-harness ..."} for a built-in server).
        world_size: The server's workers (what /get_world_size says).
        version: What /version says (None: no such route).
        logprob: The log-prob given to every generated token (and its only top-k entry).
        latency_s: How long each generate call takes (asleep).
    """

    def __init__(
        self,
        respond: Callable[[Any, int], Reply] | None = None,
        *,
        tokenizer: Any = None,
        model_id: str = "fake",
        max_model_len: int = 4096,
        server_info: dict[str, Any] | None = None,
        world_size: int = 1,
        logprob: float = -0.5,
        latency_s: float = 0.0,
        version: str | None = None,
    ) -> None:
        self.respond = respond
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.info = dict(server_info or {})
        self.world_size = world_size
        self.version = version
        self.logprob = logprob
        self.latency_s = latency_s
        self.generate_calls = 0
        self.calls: list[tuple[str, Any]] = []
        self.weights: dict[str, Any] = {}
        self.adapters: dict[str, str] = {}
        self.paused = False
        self._hooks: dict[str, Hook] = {}
        self.eos: int | None = None  # the id that ends each text reply
        if tokenizer is not None:
            end = tokenizer.convert_tokens_to_ids("<|im_end|>")
            self.eos = (
                end if isinstance(end, int) and end != tokenizer.unk_token_id else tokenizer.eos_token_id
            )

    def before(self, method: str, hook: Hook | None) -> None:
        """Run `await hook(*args)` before `method` answers (None removes it)."""
        if hook is None:
            self._hooks.pop(method, None)
        else:
            self._hooks[method] = hook

    async def _enter(self, method: str, *args: Any) -> None:
        hook = self._hooks.get(method)
        if hook is not None:
            await hook(*args)

    async def _control(self, method: str, route: str, body: Any = None) -> None:
        self.calls.append((route, body))
        await self._enter(method, *([] if body is None else [body]))

    # --- SamplingServer ---------------------------------------------------------------------------------

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        await self._enter("wait_until_ready")

    async def model_info(self, refresh: bool = False) -> ModelInfo:
        return ModelInfo(self.model_id, self.max_model_len)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        *,
        model: str | None = None,
        seed: int | None = None,
        route_key: Hashable | None = None,
    ) -> Completion:
        self.generate_calls += 1
        await self._enter("generate", prompt_ids, sampling, model)
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        if self.respond is None:
            raise GenerationError("FakeGenerationServer was given no respond function")
        prompt = self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else list(prompt_ids)
        reply = self.respond(prompt, self.generate_calls)
        if reply is None:
            raise GenerationError("the server answered 500 after every retry")
        if isinstance(reply, Completion):
            return reply
        if isinstance(reply, str):
            if self.tokenizer is None:
                raise TypeError("a text reply needs a tokenizer: FakeGenerationServer(tokenizer=...)")
            ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos]
        else:
            ids = list(reply)
        return Completion(
            output_ids=ids,
            output_log_probs=[self.logprob] * len(ids),
            output_sampler_logprobs=[{token: self.logprob} for token in ids],
            finish_reason="stop",
        )

    async def server_load(self) -> ServerLoad | None:
        return None

    def pop_metrics(self) -> dict[str, float]:
        return {}

    async def describe_candidate_sets(self, sampling: SamplingConfig) -> tuple[str, bool]:
        return "candidate sets: whatever the respond function's Completions carry", False

    # --- ServerControl ----------------------------------------------------------------------------------

    async def server_info(self) -> dict[str, Any]:
        return dict(self.info)

    async def server_version(self) -> str | None:
        return self.version

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._control("pause", "/pause", mode)
        self.paused = True

    async def resume(self) -> None:
        await self._control("resume", "/resume")
        self.paused = False

    async def start_weight_update(self) -> None:
        await self._control("start_weight_update", "/start_weight_update", {"is_checkpoint_format": True})

    async def send_weight_manifest(self, update_info: dict[str, Any]) -> None:
        await self._control("send_weight_manifest", "/update_weights", update_info)
        if "path" in update_info:  # a file sync: keep what it delivered (the file goes after the sync)
            from harness.weight_sync.wire import WeightManifest, read_weights_file

            manifest = WeightManifest.from_update_info(update_info)
            for name, tensor in read_weights_file(update_info["path"], manifest):
                self.weights[name] = tensor.clone()

    async def finish_weight_update(self) -> None:
        await self._control("finish_weight_update", "/finish_weight_update")

    async def get_world_size(self) -> int:
        await self._enter("get_world_size")  # a read: not in `calls`
        return self.world_size

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._control(
            "init_weight_transfer_engine", "/init_weight_transfer_engine", {"init_info": init_info}
        )

    async def load_lora_adapter(self, name: str, path: str | Path) -> None:
        await self._control(
            "load_lora_adapter", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
        )
        self.adapters[name] = str(path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._control("unload_lora_adapter", "/v1/unload_lora_adapter", {"lora_name": name})
        self.adapters.pop(name, None)


__all__ = ["FakeGenerationServer", "Reply"]

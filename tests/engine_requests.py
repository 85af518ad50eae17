"""Submitting requests straight to a server engine (no HTTP) and waiting for them: shared by the engine
tests."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from harness.server.engine import Engine, GenerationOutput
from harness.server.sampling import SamplingParams

_batches = itertools.count()


class Outputs(dict[str, GenerationOutput]):
    """An `on_done` callback that keeps each output by request id, in the order they ended; `done` is set
    once `expected` outputs have come."""

    def __init__(self, expected: int) -> None:
        super().__init__()
        self.expected = expected
        self.done = threading.Event()

    def __call__(self, result: GenerationOutput | BaseException) -> None:
        assert isinstance(result, GenerationOutput), result
        self[result.request_id] = result
        if len(self) == self.expected:
            self.done.set()


def run_requests(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    adapter: Any = None,
    timeout_s: float = 60.0,
    together: bool = False,
) -> list[GenerationOutput]:
    """Submit every prompt at once (one SamplingParams for all, or one each); the outputs in prompt order.

    together: submit them while the engine is paused, so that all of them reach the same scheduling step
    (otherwise the engine thread may take the first ones before the last are submitted, as it may on a
    loaded machine)."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    batch = next(_batches)
    outputs: dict[str, GenerationOutput] = {}
    done = threading.Event()

    def on_done(result: GenerationOutput | BaseException) -> None:
        assert isinstance(result, GenerationOutput), result
        outputs[result.request_id] = result
        if len(outputs) == len(prompts):
            done.set()

    if together:
        engine.pause("keep").result(timeout_s)
    for i, (prompt, param) in enumerate(zip(prompts, each, strict=True)):
        engine.submit(prompt, param, on_done, request_id=f"{batch}-{i}", adapter=adapter)
    if together:
        engine.resume().result(timeout_s)
    assert done.wait(timeout_s)
    return [outputs[f"{batch}-{i}"] for i in range(len(prompts))]

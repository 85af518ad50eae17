"""The trainer's way to get a generation server: start `harness serve` as a subprocess, use it, stop it."""

from __future__ import annotations

import logging
import subprocess
import sys

import anyio
import pytest

from harness.generation.client import GenerationClient
from harness.generation.protocol import SamplingConfig
from harness.server.launch import ServerStartError, open_generation_server, start_builtin_server


@pytest.mark.slow
def test_builtin_server_subprocess_serves_and_stops(tiny_model_dir, tmp_path, caplog):
    log_path = tmp_path / "server.log"
    caplog.set_level(logging.INFO, logger="harness.server.launch")

    async def generate(url: str) -> list[int]:
        async with GenerationClient(url, timeout_s=60) as client:
            info = await client.model_info()
            assert info.max_model_len == 512
            completion = await client.generate([5, 6, 7], SamplingConfig(max_tokens=4, num_logprobs=1))
            return completion.output_ids

    with open_generation_server(
        None,
        model=tiny_model_dir,
        max_model_len=512,
        device="cpu",
        num_threads=1,
        log_path=log_path,
        timeout_s=120,
    ) as url:
        assert anyio.run(generate, url)
        (line,) = [r.getMessage() for r in caplog.records if "generation server" in r.getMessage()]
        assert line.startswith("generation server: built-in") and url in line
        pid = int(line.split("pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)  # gone: stopped with the context
    assert "harness serve" in log_path.read_text()
    assert "(torch.float32, 1 threads)" in log_path.read_text()  # --num-threads reached torch


def test_an_external_url_is_used_as_is(caplog):
    caplog.set_level(logging.INFO, logger="harness.server.launch")
    with open_generation_server("http://gpu-box:8000", model="unused") as url:
        assert url == "http://gpu-box:8000"
    assert "external vLLM-protocol server at http://gpu-box:8000" in caplog.text


@pytest.mark.slow
def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    with pytest.raises(ServerStartError, match="exited with status") as raised:
        start_builtin_server(tmp_path / "no-model-here", log_path=tmp_path / "server.log", timeout_s=120)
    assert "no-model-here" in str(raised.value)


def test_serve_help_is_fast_and_lists_the_flags():
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--port", "--max-model-len", "--dtype", "--device", "--enable-lora", "--kv-cache-tokens"):
        assert flag in out


@pytest.mark.slow
def test_the_port_folder_is_gone_once_the_server_answers(tiny_model_dir):
    """The folder the server writes its port into is deleted as soon as the port is read, so a parent
    killed while the server runs leaves no temporary folder behind."""
    with start_builtin_server(tiny_model_dir, device="cpu", timeout_s=120) as server:
        assert not server._workdir.exists()


def test_a_cpu_server_beside_cpu_training_gets_half_the_cores(monkeypatch):
    import torch

    from harness.training.generation_side import split_cpu_threads
    from harness.training.processes import Processes

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    with split_cpu_threads(Processes(rank=0, world_size=1)) as server_threads:
        assert (server_threads, torch.get_num_threads()) == (4, 4)
    assert torch.get_num_threads() == before
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two training processes on this host share the other half
    with split_cpu_threads(Processes(rank=1, world_size=2)) as server_threads:
        assert (server_threads, torch.get_num_threads()) == (4, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user placed threads: leave them
    with split_cpu_threads(Processes(rank=0, world_size=1)) as server_threads:
        assert server_threads is None and torch.get_num_threads() == before
    assert torch.get_num_threads() == before

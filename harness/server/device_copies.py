"""Host-to-device copies that never make the host wait.

Who talks to it: the sampling step (`sampling.py`) and the CUDA graphs' decode inputs (`cuda_graphs.py`),
whenever they move per-step values (draws, temperatures, lengths, row indices) to the GPU.

Why: a copy from ordinary (pageable) host memory to the GPU first waits for the work already queued on the
stream, so a copy made after launching a forward blocks the host until that forward ends. From pinned
memory the copy is queued like a kernel and the host goes on, which is what lets the engine prepare and
launch a step while the previous one still runs. PyTorch's pinned-memory cache keeps each buffer until its
copy has run, so a buffer may be dropped as soon as the copy is queued.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (a list, nested or not) on `device`, copied without waiting on a GPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


__all__ = ["to_device"]

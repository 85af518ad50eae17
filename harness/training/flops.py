"""Model FLOPs utilisation: the share of the accelerator's dense peak that the training step's useful
arithmetic used.

The trainer logs `perf/fwd_bwd_mfu` (over the forward/backward time) and `perf/wall_clock_mfu` (over the
whole step, waiting and weight sync included) when the peak is known: a CUDA device this table names,
training in bf16 or fp16. Useful arithmetic is the usual 6 x parameters x forwarded tokens (forward 2,
backward 4); attention's quadratic part, gradient checkpointing's recomputation and padding are not
counted, so the figure is a floor on what the hardware did. On CPU, in float32, or on an unlisted device
nothing is logged: a guessed peak would make the number meaningless.
"""

from __future__ import annotations

import torch

# Dense bf16/fp16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name() (first match).
DENSE_HALF_PRECISION_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
)


def peak_flops(device_name: str, *, half_precision: bool) -> float | None:
    """The dense peak for `device_name` in bf16/fp16, or None when it is not known."""
    if not half_precision:
        return None
    return next((peak for key, peak in DENSE_HALF_PRECISION_PEAKS if key in device_name), None)


def device_peak_flops(device: torch.device, *, half_precision: bool) -> float | None:
    """`peak_flops` of a torch device (None on CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(device), half_precision=half_precision)


def training_flops(num_parameters: int, forwarded_tokens: int) -> float:
    """Forward plus backward arithmetic of a dense decoder: 6 x parameters x tokens."""
    return 6.0 * num_parameters * forwarded_tokens

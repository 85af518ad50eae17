"""MFU bookkeeping: the peak table and the FLOP count the trainer's perf/*_mfu metrics use."""

from __future__ import annotations

import pytest
import torch

from harness.training.flops import device_peak_flops, peak_flops, training_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),  # the PCIe card is slower: matched before plain "H100"
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 3090", None),  # not in the table: no guess
    ],
)
def test_half_precision_peaks_by_device_name(name, peak):
    assert peak_flops(name, half_precision=True) == peak


def test_no_peak_in_float32_or_on_cpu():
    assert peak_flops("NVIDIA H200", half_precision=False) is None
    assert device_peak_flops(torch.device("cpu"), half_precision=True) is None


def test_training_flops_are_six_per_parameter_per_token():
    assert training_flops(num_parameters=1_000, forwarded_tokens=10) == 60_000

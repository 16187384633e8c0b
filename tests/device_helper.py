"""The devices a device-parametrized test runs on: the CPU always, CUDA where there is one.

``benchmarks/gpu/gpu_check.sh`` runs ``tests/device/`` on a lent GPU; elsewhere the CUDA cases
are skipped with the reason, and the CPU cases run the same code.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["CUDA_REASON", "DEVICES", "on_device", "synchronize"]

CUDA_REASON = (
    "CUDA is not available here (torch.cuda.is_available() is False); "
    "benchmarks/gpu/gpu_check.sh runs these cases on a GPU"
)

#: ``@pytest.mark.parametrize("device", DEVICES)``: "cpu", and "cuda" (skipped without one).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON),
    ),
]


def on_device(name: str) -> torch.device:
    """The ``torch.device`` of a :data:`DEVICES` name (CUDA: the current device)."""
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

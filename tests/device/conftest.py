"""The ``device`` fixture of the device-parametrized tests (tests/device_helper.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from device_helper import DEVICES, on_device


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU, then CUDA where it is available (skipped with the reason elsewhere)."""
    return on_device(request.param)


@pytest.fixture(autouse=True)
def full_float32_products() -> Iterator[None]:
    """No TF32 in CUDA matmuls and convolutions (cuDNN's default is TF32), so that CUDA
    results are held to float32 tolerance, as the CPU's are."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

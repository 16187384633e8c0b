"""The ``device`` fixture of the device-parametrized tests (tests/device_helper.py)."""

from __future__ import annotations

import pytest
import torch

from device_helper import DEVICES, on_device


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU, then CUDA where it is available (skipped with the reason elsewhere)."""
    return on_device(request.param)

"""K-FAC factors for ``nn.Conv1d``: the Conv2d math on the input viewed as ``[B, C, 1, L]``.

A length-``k`` kernel is a ``1 × k`` one over a height-1 image, so every factor method of
:mod:`spdkfac.layers.conv2d` (fast kernels included) applies unchanged, for any stride,
padding (string modes and non-zero padding modes too) and dilation.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.layers.conv2d import Conv2dLayer
from spdkfac.layers.geometry import Conv2dGeometry

__all__ = ["Conv1dLayer"]


class Conv1dLayer(Conv2dLayer):
    """Adapter for ``nn.Conv1d`` with ``groups == 1`` (see the module docstring)."""

    module_types = (nn.Conv1d,)

    def geometry(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, Conv2dGeometry]:
        assert isinstance(module, nn.Conv1d)
        padding = 0
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            pad = module._reversed_padding_repeated_twice
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            if any(pad):
                inputs = F.pad(inputs, list(pad), mode=mode)
        else:
            padding = int(module.padding[0])
        image = inputs.unsqueeze(2)
        geometry = Conv2dGeometry.of(
            image,
            (1, int(module.kernel_size[0])),
            (1, int(module.stride[0])),
            (0, padding),
            (1, int(module.dilation[0])),
            bias=self.has_bias(module),
            compute_dtype=self.options.compute_dtype,
        )
        return image, geometry

    def grad_4d(self, grad_output: Tensor) -> Tensor:
        return grad_output.unsqueeze(2)

"""The geometry of one Conv2d A factor call: input shape, convolution, bias, compute dtype.

Every Conv2d A factor function (reference, im2col, correlation), the method choice and the
cost model take one :class:`Conv2dGeometry` rather than the convolution's parameters one
by one; :meth:`Conv2dGeometry.of` is the one place that lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from spdkfac.layers.kernels import resolve_compute_dtype

__all__ = ["Conv2dGeometry", "Pair"]

#: (height, width) of a size, a kernel, a stride, a padding or a dilation.
Pair = tuple[int, int]


@dataclass(frozen=True)
class Conv2dGeometry:
    """Everything a Conv2d A factor depends on besides the data (hashable, a cache key).

    Attributes:
        batch: Examples in the input.
        channels: Input channels (C).
        size: Input height and width, already padded for non-zero padding modes.
        kernel_size: Kernel height and width (kh, kw).
        stride: The convolution's stride.
        padding: Zero padding on each side (what ``unfold`` adds).
        dilation: The convolution's dilation.
        bias: Whether the factor has the bias row and column.
        compute_dtype: The dtype the products run in, as resolved by
            :func:`~spdkfac.layers.kernels.resolve_compute_dtype`.
        device_type: ``"cpu"``, ``"cuda"``, ... of the input.
    """

    batch: int
    channels: int
    size: Pair
    kernel_size: Pair
    stride: Pair
    padding: Pair
    dilation: Pair
    bias: bool
    compute_dtype: torch.dtype
    device_type: str

    @classmethod
    def of(
        cls,
        inputs: Tensor,
        kernel_size: Pair,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        *,
        bias: bool,
        compute_dtype: torch.dtype | None = None,
    ) -> Conv2dGeometry:
        """The geometry of the Conv2d A factor of ``inputs`` (``[B, C, H, W]``).

        Args:
            inputs: The layer input, already padded for non-zero padding modes.
            kernel_size, stride, padding, dilation: The convolution (zero padding).
            bias: Append the bias row and column.
            compute_dtype: Requested compute dtype; None keeps the input's. Resolved here
                (see :func:`~spdkfac.layers.kernels.resolve_compute_dtype`).

        Raises:
            ValueError: If the padded input is smaller than the dilated kernel, or for a
                non-floating-point dtype.
        """
        batch, channels, height, width = (int(n) for n in inputs.shape)
        requested = inputs.dtype if compute_dtype is None else compute_dtype
        geometry = cls(
            batch=batch,
            channels=channels,
            size=(height, width),
            kernel_size=kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            bias=bias,
            compute_dtype=requested,
            device_type=inputs.device.type,
        )
        dtype = resolve_compute_dtype(
            compute_dtype, inputs.dtype, rows=geometry.rows, dim=geometry.dim
        )
        return geometry if dtype == requested else replace(geometry, compute_dtype=dtype)

    @property
    def output_size(self) -> Pair:
        """Output height and width of the convolution.

        Raises:
            ValueError: If the (padded) input is smaller than the dilated kernel.
        """
        size, kernel, stride, padding, dilation = (
            self.size,
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
        )
        out = tuple(
            (size[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
            for i in range(2)
        )
        if out[0] < 1 or out[1] < 1:
            raise ValueError(
                f"input of size {size} with padding {padding} is smaller than the kernel "
                f"{kernel} with dilation {dilation}"
            )
        return (out[0], out[1])

    @property
    def rows(self) -> int:
        """Patch rows, ``B·oh·ow``: the outer products the factor averages."""
        out_h, out_w = self.output_size
        return self.batch * out_h * out_w

    @property
    def dim(self) -> int:
        """Side of the factor without the bias entry, ``C·kh·kw``."""
        return self.channels * self.kernel_size[0] * self.kernel_size[1]

    def check_input(self, inputs: Tensor) -> None:
        """Raise ``ValueError`` unless ``inputs`` has this geometry's ``[B, C, H, W]``."""
        expected = (self.batch, self.channels, *self.size)
        if tuple(inputs.shape) != expected:
            raise ValueError(
                f"input of shape {tuple(inputs.shape)} does not match the geometry's {expected}"
            )

"""K-FAC factors for ``nn.Linear``: A = āᵀā/B, G = δᵀδ/B with δ = B·g (leading dims folded)."""

from __future__ import annotations

from torch import Tensor, nn

from spdkfac.layers.base import KFACLayer
from spdkfac.layers.factors import covariance

__all__ = ["LinearLayer", "linear_a_factor", "linear_g_factor"]


def linear_a_factor(inputs: Tensor, bias: bool) -> Tensor:
    """A = āᵀā / N over the N rows of ``inputs`` (all leading dims folded into the batch).

    Args:
        inputs: ``[..., in]`` layer input.
        bias: Append a constant-1 column (ā = [a, 1]).

    Returns:
        ``[in(+1), in(+1)]`` symmetric factor.
    """
    rows = inputs.reshape(-1, inputs.shape[-1])
    return covariance(rows, bias=bias)


def linear_g_factor(grad_output: Tensor) -> Tensor:
    """G = δᵀδ / N with δ = N·g, i.e. N·gᵀg over the N folded rows of ``grad_output``."""
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    count = rows.shape[0]
    return covariance(rows, bias=False).mul_(float(count) * float(count))


class LinearLayer(KFACLayer):
    """Adapter for ``nn.Linear``."""

    module_types = (nn.Linear,)

    def a_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Linear)
        return module.in_features + int(self.has_bias(module))

    def g_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Linear)
        return module.out_features

    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        rows = inputs.numel() // inputs.shape[-1]
        return linear_a_factor(inputs, self.has_bias(module)), rows

    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        rows = grad_output.numel() // grad_output.shape[-1]
        return linear_g_factor(grad_output), rows

"""K-FAC factors for ``nn.Linear``: A = āᵀā/B, G = δᵀδ/B with δ = B·g (leading dims folded)."""

from __future__ import annotations

from torch import Tensor, nn

from spdkfac.layers.base import KFACLayer
from spdkfac.layers.factors import covariance
from spdkfac.layers.gram import linear_a_factor_gram, linear_g_factor_gram
from spdkfac.layers.options import FactorOptions

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
    """Adapter for ``nn.Linear``.

    Args:
        options: How factors are computed; the default is one triangular Gram product
            (``compute_dtype`` applies), ``FactorOptions(method="reference")`` runs
            :func:`linear_a_factor` and :func:`linear_g_factor`.
    """

    module_types = (nn.Linear,)

    def __init__(self, *, options: FactorOptions | None = None) -> None:
        self.options = FactorOptions() if options is None else options

    def with_options(self, options: FactorOptions) -> LinearLayer:
        return LinearLayer(options=options)

    def a_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Linear)
        return module.in_features + int(self.has_bias(module))

    def g_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Linear)
        return module.out_features

    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        rows = inputs.numel() // inputs.shape[-1]
        if self.options.method == "reference":
            return linear_a_factor(inputs, self.has_bias(module)), rows
        factor = linear_a_factor_gram(
            inputs, self.has_bias(module), compute_dtype=self.options.compute_dtype
        )
        return factor, rows

    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        rows = grad_output.numel() // grad_output.shape[-1]
        if self.options.method == "reference":
            return linear_g_factor(grad_output), rows
        return linear_g_factor_gram(grad_output, compute_dtype=self.options.compute_dtype), rows

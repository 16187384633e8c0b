"""K-FAC factors for ``nn.Linear``: A = āᵀā/N, G = δᵀδ/N with δ = N·g (leading dims folded).

A Linear layer applied at T positions of each of B examples (a sequence model) shares its
weight over the positions. Eschenhagen et al. (NeurIPS 2023, "Kronecker-Factored
Approximate Curvature for Modern Neural Network Architectures", Sec. 3) define two
factorizations, both here:

* **expand** (the default): every position is an example, N = B·T rows:
  ``A = (1/N) Σ ā ā ᵀ``, ``G = N Σ g gᵀ`` (g the output gradient of the loss, which is
  assumed to average over the N positions, as a language model's does);
* **reduce**: the inputs are averaged and the output gradients summed over the positions
  of each example first, ``ā_n = (1/T) Σ_t ā_nt``, ``ĝ_n = Σ_t g_nt``:
  ``A = (1/B) Σ_n ā_n ā_nᵀ``, ``G = B·T Σ_n ĝ_n ĝ_nᵀ`` — factor cost independent of T.

Both are the definitions of ``curvlinops``' ``KFACLinearOperator`` (``kfac_approx``
``"expand"`` / ``"reduce"``, loss averaged over batch and positions), which the tests check.
Inputs with no position dimensions (``[B, in]``) give the same factors either way.
"""

from __future__ import annotations

from torch import Tensor, nn

from spdkfac.layers.base import KFACLayer
from spdkfac.layers.factors import covariance
from spdkfac.layers.gram import linear_a_factor_gram, linear_g_factor_gram, rows_gram
from spdkfac.layers.options import FactorOptions
from spdkfac.types import WeightSharing

__all__ = [
    "LinearLayer",
    "linear_a_factor",
    "linear_a_factor_reduce",
    "linear_g_factor",
    "linear_g_factor_reduce",
]


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


def _per_example(tensor: Tensor, *, mean: bool) -> tuple[Tensor, int]:
    """``[B, ..., d]`` → ``[B, d]`` averaged (or summed) over the positions, and T."""
    if tensor.dim() <= 2:
        rows = tensor.reshape(-1, tensor.shape[-1])
        return rows, 1
    flat = tensor.reshape(tensor.shape[0], -1, tensor.shape[-1])
    reduced = flat.mean(dim=1) if mean else flat.sum(dim=1)
    return reduced, flat.shape[1]


def linear_a_factor_reduce(inputs: Tensor, bias: bool) -> Tensor:
    """K-FAC-reduce A: the second moment of each example's mean input (ā = [a, 1])."""
    examples, _ = _per_example(inputs, mean=True)
    return covariance(examples, bias=bias)


def linear_g_factor_reduce(grad_output: Tensor) -> Tensor:
    """K-FAC-reduce G: ``B·T Σ_n ĝ_n ĝ_nᵀ`` with ĝ_n the gradient summed over positions."""
    examples, positions = _per_example(grad_output, mean=False)
    count = examples.shape[0]
    return covariance(examples, bias=False).mul_(float(count) * float(count * positions))


class LinearLayer(KFACLayer):
    """Adapter for ``nn.Linear``.

    Args:
        options: How factors are computed; the default is one triangular Gram product
            (``compute_dtype`` applies), ``FactorOptions(method="reference")`` runs the
            plain functions of this module.
        weight_sharing: ``"expand"`` or ``"reduce"`` (see the module docstring).
    """

    module_types: tuple[type[nn.Module], ...] = (nn.Linear,)

    def __init__(
        self, *, options: FactorOptions | None = None, weight_sharing: WeightSharing = "expand"
    ) -> None:
        self.options = FactorOptions() if options is None else options
        self.weight_sharing = weight_sharing

    def with_options(
        self, options: FactorOptions, *, weight_sharing: WeightSharing = "expand"
    ) -> LinearLayer:
        return LinearLayer(options=options, weight_sharing=weight_sharing)

    def a_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Linear)
        return module.in_features + int(self.has_bias(module))

    def g_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Linear)
        return module.out_features

    def _reduces(self, tensor: Tensor) -> bool:
        return self.weight_sharing == "reduce" and tensor.dim() > 2

    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        bias = self.has_bias(module)
        reference = self.options.method == "reference"
        if self._reduces(inputs):
            if reference:
                return linear_a_factor_reduce(inputs, bias), inputs.shape[0]
            examples, _ = _per_example(inputs, mean=True)
            count = examples.shape[0]
            factor = rows_gram(
                examples, alpha=1.0 / count, bias=bias, compute_dtype=self.options.compute_dtype
            )
            return factor, count
        rows = inputs.numel() // inputs.shape[-1]
        if reference:
            return linear_a_factor(inputs, bias), rows
        factor = linear_a_factor_gram(inputs, bias, compute_dtype=self.options.compute_dtype)
        return factor, rows

    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        reference = self.options.method == "reference"
        if self._reduces(grad_output):
            if reference:
                return linear_g_factor_reduce(grad_output), grad_output.shape[0]
            examples, positions = _per_example(grad_output, mean=False)
            count = examples.shape[0]
            factor = rows_gram(
                examples,
                alpha=float(count * positions),
                bias=False,
                compute_dtype=self.options.compute_dtype,
            )
            return factor, count
        rows = grad_output.numel() // grad_output.shape[-1]
        if reference:
            return linear_g_factor(grad_output), rows
        return linear_g_factor_gram(grad_output, compute_dtype=self.options.compute_dtype), rows

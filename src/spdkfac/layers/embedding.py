"""K-FAC factors for ``nn.Embedding``: a bias-free Linear layer on one-hot inputs.

A lookup ``y = W[i]`` of an ``[V, d]`` table is ``y = Wᵀ e_i``: a Linear layer from the
one-hot ``e_i`` to ``d`` outputs. Its A factor ``(1/N) Σ e eᵀ`` is diagonal — the token
frequencies — so it is kept as a ``[V]`` vector (O(V) memory) and inverted in closed form;
G is Linear's over the N looked-up positions (K-FAC-expand: every position is a row, see
:mod:`spdkfac.layers.linear`; a reduced A would no longer be diagonal, so embeddings always
expand). The gradient matrix is ``∇Wᵀ`` (``[d, V]``); rows of ``padding_idx`` have a zero
gradient and keep it, as in the plain gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spdkfac.layers.base import LOCAL_GRADIENTS, GradientAccess, KFACLayer
from spdkfac.layers.gram import linear_g_factor_gram
from spdkfac.layers.linear import linear_g_factor
from spdkfac.layers.options import FactorOptions
from spdkfac.types import WeightSharing

__all__ = ["EmbeddingLayer", "embedding_a_factor"]


def embedding_a_factor(indices: Tensor, num_embeddings: int, dtype: torch.dtype) -> Tensor:
    """Diagonal of A: how often each of the ``num_embeddings`` rows was looked up, over N."""
    flat = indices.reshape(-1)
    counts = torch.bincount(flat, minlength=num_embeddings).to(dtype)
    return counts.div_(float(max(flat.numel(), 1)))


class EmbeddingLayer(KFACLayer):
    """Adapter for ``nn.Embedding`` (dense gradients, no ``scale_grad_by_freq``).

    Args:
        options: ``method="reference"`` computes G with the plain function; otherwise
            one triangular Gram product (``compute_dtype`` applies).
    """

    module_types = (nn.Embedding,)
    #: A is kept as its diagonal (see the module docstring).
    diagonal_a = True

    def __init__(self, *, options: FactorOptions | None = None) -> None:
        self.options = FactorOptions() if options is None else options

    def with_options(
        self, options: FactorOptions, *, weight_sharing: WeightSharing = "expand"
    ) -> EmbeddingLayer:
        return EmbeddingLayer(options=options)

    def supports(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.Embedding) and not module.sparse and not module.scale_grad_by_freq
        )

    def has_bias(self, module: nn.Module) -> bool:
        return False

    def a_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Embedding)
        return module.num_embeddings

    def g_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Embedding)
        return module.embedding_dim

    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        weight = module.weight
        assert isinstance(module, nn.Embedding) and isinstance(weight, Tensor)
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        return embedding_a_factor(inputs, module.num_embeddings, dtype), inputs.numel()

    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        rows = grad_output.numel() // grad_output.shape[-1]
        if self.options.method == "reference":
            return linear_g_factor(grad_output), rows
        return linear_g_factor_gram(grad_output, compute_dtype=self.options.compute_dtype), rows

    def gradient(
        self, module: nn.Module, access: GradientAccess = LOCAL_GRADIENTS
    ) -> Tensor | None:
        weight = module.weight
        assert isinstance(weight, Tensor)
        grad = access.read(weight)
        return None if grad is None else grad.t()

    def set_gradient(
        self, module: nn.Module, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS
    ) -> None:
        weight = module.weight
        assert isinstance(weight, Tensor)
        access.write(weight, matrix.t())

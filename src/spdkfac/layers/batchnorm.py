"""Osawa et al.'s BatchNorm curvature: per-channel Fisher blocks over (γ_c, β_c).

A BatchNorm layer ``y = γ ⊙ x̂ + β`` (``x̂`` the input normalized with the batch statistics)
is not Kronecker factored. Its Fisher is built from the per-example gradients of the scale
and shift, which are exact shares of the batch gradient (``∇γ = Σₙ uₙ``, ``∇β = Σₙ vₙ``)::

    uₙ_c = Σₛ δₙ_cs · x̂ₙ_cs        vₙ_c = Σₛ δₙ_cs        (δ = B·g, docs/guide.md "Conventions")

summed over the positions ``s`` of example ``n`` (none for ``[B, C]`` inputs). Osawa et al.
(2019, CVPR, Sec. 5, the diagonal-Fisher experiment) keep only the diagonal of the
``2C × 2C`` Fisher; the ``unit-wise`` mode keeps each channel's ``2 × 2`` block
``(1/B) Σₙ [uₙ_c, vₙ_c]ᵀ[uₙ_c, vₙ_c]``.
Either way a layer's curvature is stored as a ``[C, 3]`` tensor of the block entries
``(F_γγ, F_γβ, F_ββ)`` (``F_γβ = 0`` in the diagonal mode), inverted in closed form.
The blocks are computed by :func:`spdkfac.layers.normalization.unit_fisher`, shared with
the other normalization layers; this module keeps what is BatchNorm's own.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor, nn

from spdkfac.types import NormalizationMode

__all__ = [
    "BATCHNORM_MODES",
    "is_supported_batchnorm",
    "normalized_input",
    "precondition_units",
    "unit_inverses",
]

#: Curvature modes for BatchNorm layers (``None`` in the options: plain gradient).
BATCHNORM_MODES: tuple[str, ...] = get_args(NormalizationMode)

_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def is_supported_batchnorm(module: nn.Module) -> bool:
    """BatchNorm1d/2d/3d (or a subclass keeping their forward) with a trainable affine scale.

    ``SyncBatchNorm`` normalizes with cross-rank statistics and is not supported.
    """
    if not isinstance(module, _BATCHNORM_TYPES):
        return False
    if type(module).forward is not nn.modules.batchnorm._BatchNorm.forward:
        return False
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    return (
        isinstance(weight, Tensor)
        and isinstance(bias, Tensor)
        and weight.requires_grad
        and weight.dim() == 1
    )


def normalized_input(inputs: Tensor, eps: float) -> Tensor:
    """``x̂ = (x − mean) / sqrt(var + eps)`` with the batch statistics of a training forward.

    Args:
        inputs: ``[B, C, *]`` input of the BatchNorm layer (``[B, C]`` for BatchNorm1d).
        eps: The layer's ``eps``.
    """
    dims = [0, *range(2, inputs.dim())]
    mean = inputs.mean(dim=dims, keepdim=True)
    variance = inputs.var(dim=dims, unbiased=False, keepdim=True)
    return (inputs - mean) * torch.rsqrt(variance + eps)


def unit_inverses(fisher: Tensor, damping: float) -> Tensor:
    """Closed-form ``(F_c + λI)⁻¹`` of every channel's ``2 × 2`` block, as ``[C, 3]`` entries.

    Computed in float64: ``F_γγ·F_ββ − F_γβ²`` cancels when the two gradients are nearly
    collinear, and it is clamped at 0 (a Gram determinant) so rounding cannot make the
    damped determinant ``det(F) + λ·tr(F) + λ²`` smaller than ``λ²``.

    Args:
        fisher: ``[C, 3]`` block entries ``(F_γγ, F_γβ, F_ββ)``.
        damping: λ > 0.

    Returns:
        ``[C, 3]`` entries ``(I_γγ, I_γβ, I_ββ)`` of the inverse, in ``fisher``'s dtype.
    """
    wide = fisher.to(torch.float64)
    scale, cross, shift = wide.unbind(dim=1)
    gram = (scale * shift - cross * cross).clamp_min(0.0)
    determinant = gram + damping * (scale + shift) + damping * damping
    inverse = torch.stack([shift + damping, -cross, scale + damping], dim=1) / determinant[:, None]
    return inverse.to(fisher.dtype)


def precondition_units(gradient: Tensor, inverse: Tensor) -> Tensor:
    """Every channel's ``[∇γ_c, ∇β_c]`` times its inverse block: ``[C, 2]`` → ``[C, 2]``."""
    scale, shift = gradient.unbind(dim=1)
    inv_scale, inv_cross, inv_shift = inverse.unbind(dim=1)
    return torch.stack(
        [inv_scale * scale + inv_cross * shift, inv_cross * scale + inv_shift * shift], dim=1
    )

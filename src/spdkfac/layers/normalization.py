"""Normalization layers' curvature: per-unit Fisher blocks over their scale and shift.

Generalizes Osawa et al.'s BatchNorm blocks (:mod:`spdkfac.layers.batchnorm`) to every
normalization layer ``y = γ ⊙ x̂ + β`` with per-unit affine parameters: BatchNorm,
GroupNorm (``x̂`` normalized per example and group, ``γ`` per channel), LayerNorm and
RMSNorm (``x̂`` normalized over the trailing ``normalized_shape``, ``γ`` per element of it;
RMSNorm and ``bias=False`` LayerNorm have no β — its entries are zero, and the damped 2×2
inverse then reduces exactly to ``1/(F_γγ + λ)``).

Which positions form one "example" follows where the parameters sit:

* channel-first layers (BatchNorm, GroupNorm, ``[B, C, *]``): the example is the batch
  entry, its share of ``∇γ_c`` summed over the spatial positions, δ = B·g;
* trailing layers (LayerNorm, RMSNorm, ``[..., *normalized_shape]``): every leading
  position is an example (N rows, δ = N·g) — the K-FAC-expand convention of
  :mod:`spdkfac.layers.linear`, so a transformer's norms and Linear layers are on the same
  scale.

Either way a layer's blocks are stored as ``[P, 3]`` entries ``(F_γγ, F_γβ, F_ββ)`` for its
P units, as BatchNorm's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.layers.base import LOCAL_GRADIENTS, GradientAccess
from spdkfac.layers.batchnorm import is_supported_batchnorm, normalized_input

__all__ = [
    "NORM_KINDS",
    "NormKind",
    "has_shift",
    "norm_gradient",
    "norm_kind",
    "unit_fisher",
    "write_norm_gradient",
]


def _eps(module: nn.Module, inputs: Tensor) -> float:
    eps = getattr(module, "eps", None)
    return float(torch.finfo(inputs.dtype).eps) if eps is None else float(eps)


def _batchnorm(module: nn.Module, inputs: Tensor) -> Tensor:
    return normalized_input(inputs, _eps(module, inputs))


def _groupnorm(module: nn.Module, inputs: Tensor) -> Tensor:
    assert isinstance(module, nn.GroupNorm)
    grouped = inputs.reshape(inputs.shape[0], module.num_groups, -1)
    mean = grouped.mean(dim=2, keepdim=True)
    variance = grouped.var(dim=2, unbiased=False, keepdim=True)
    return ((grouped - mean) * torch.rsqrt(variance + _eps(module, inputs))).reshape(inputs.shape)


def _layernorm(module: nn.Module, inputs: Tensor) -> Tensor:
    assert isinstance(module, nn.LayerNorm)
    return F.layer_norm(inputs, module.normalized_shape, eps=_eps(module, inputs))


def _rmsnorm(module: nn.Module, inputs: Tensor) -> Tensor:
    assert isinstance(module, nn.RMSNorm)
    dims = tuple(range(-len(module.normalized_shape), 0))
    mean_square = inputs.pow(2).mean(dim=dims, keepdim=True)
    return inputs * torch.rsqrt(mean_square + _eps(module, inputs))


@dataclass(frozen=True)
class NormKind:
    """One family of normalization layers.

    Attributes:
        name: Short name used in descriptions.
        supports: Whether a module is of this family and has a trainable affine scale.
        normalize: ``x̂`` of a training-mode forward, in the input's layout.
        channel_first: Units along dim 1 (else the trailing dims are the units).
    """

    name: str
    supports: Callable[[nn.Module], bool]
    normalize: Callable[[nn.Module, Tensor], Tensor]
    channel_first: bool


def _trainable_scale(module: nn.Module, types: tuple[type[nn.Module], ...]) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, types)
        and isinstance(weight, Tensor)
        and weight.requires_grad
        and type(module).forward is types[0].forward
    )


#: Supported normalization families, in lookup order.
NORM_KINDS: tuple[NormKind, ...] = (
    NormKind("bn", is_supported_batchnorm, _batchnorm, channel_first=True),
    NormKind("gn", lambda m: _trainable_scale(m, (nn.GroupNorm,)), _groupnorm, True),
    NormKind("ln", lambda m: _trainable_scale(m, (nn.LayerNorm,)), _layernorm, False),
    NormKind("rms", lambda m: _trainable_scale(m, (nn.RMSNorm,)), _rmsnorm, False),
)


def norm_kind(module: nn.Module) -> NormKind | None:
    """The family of a supported normalization layer, or None."""
    return next((kind for kind in NORM_KINDS if kind.supports(module)), None)


def unit_fisher(
    normalized: Tensor,
    grad_output: Tensor,
    *,
    units: int,
    channel_first: bool,
    diagonal: bool,
    shift: bool = True,
) -> tuple[Tensor, int]:
    """The ``[P, 3]`` block entries of one forward/backward call, and its examples.

    ``F = (1/E) Σₑ [uₑ, vₑ]ᵀ[uₑ, vₑ]`` per unit, ``u = E·Σ g·x̂``, ``v = E·Σ g`` summed over
    the positions of example ``e`` (see the module docstring for what an example is).

    Args:
        normalized: ``x̂``, the shape of ``grad_output``.
        grad_output: Output gradient of the loss.
        units: P, the number of affine parameters.
        channel_first: Units along dim 1 (else trailing).
        diagonal: Drop the γ–β coupling (``F_γβ = 0``).
        shift: The layer has a β (else its entries are zero).
    """
    if channel_first:
        examples = grad_output.shape[0]
        grad = grad_output.reshape(examples, units, -1)
        gamma = (grad * normalized.reshape(examples, units, -1)).sum(dim=2)
        beta = grad.sum(dim=2)
    else:
        grad = grad_output.reshape(-1, units)
        examples = grad.shape[0]
        gamma = grad * normalized.reshape(-1, units)
        beta = grad
    gamma = gamma * float(examples)
    beta = beta * float(examples) if shift else torch.zeros_like(gamma)
    cross = torch.zeros_like(gamma[0]) if diagonal else (gamma * beta).mean(dim=0)
    blocks = torch.stack([(gamma * gamma).mean(dim=0), cross, (beta * beta).mean(dim=0)], dim=1)
    return blocks, examples


def _bias(module: nn.Module) -> Tensor | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, Tensor) else None


def has_shift(module: nn.Module) -> bool:
    """Whether the layer has a trainable β (RMSNorm and ``bias=False`` LayerNorm have none;
    a frozen β is a constant, left out of the block: its entries are zero)."""
    bias = _bias(module)
    return bias is not None and bias.requires_grad


def norm_gradient(
    module: nn.Module, access: GradientAccess = LOCAL_GRADIENTS, *, shift: bool = True
) -> Tensor | None:
    """``[P, 2]`` matrix ``[∇γ, ∇β]`` (β's as zeros when absent, or when ``shift`` is
    False: the block has no β); None without ∇γ."""
    weight, bias = module.weight, _bias(module)
    assert isinstance(weight, Tensor)
    weight_grad = access.read(weight)
    if weight_grad is None:
        return None
    scale = weight_grad.reshape(-1)
    bias_grad = None if bias is None or not shift else access.read(bias)
    column = torch.zeros_like(scale) if bias_grad is None else bias_grad.reshape(-1)
    return torch.stack([scale, column], dim=1)


def write_norm_gradient(
    module: nn.Module,
    matrix: Tensor,
    access: GradientAccess = LOCAL_GRADIENTS,
    *,
    shift: bool = True,
) -> None:
    """Write a ``[P, 2]`` matrix back as ``weight``'s and ``bias``'s gradients (the bias
    only where it has one, in the block, ``shift``)."""
    weight, bias = module.weight, _bias(module)
    assert isinstance(weight, Tensor)
    access.write(weight, matrix[:, 0].reshape(weight.shape))
    # Whether the bias has a gradient, from ``.grad``: not access.read, a gather under FSDP2.
    if shift and bias is not None and bias.grad is not None:
        access.write(bias, matrix[:, 1].reshape(bias.shape))

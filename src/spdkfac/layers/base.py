"""The contract every supported layer type implements, and the math all of them share."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Protocol

import torch
from torch import Tensor, nn

from spdkfac.layers.options import FactorOptions
from spdkfac.types import WeightSharing

__all__ = [
    "LOCAL_GRADIENTS",
    "GradientAccess",
    "KFACLayer",
    "LocalGradients",
    "gradient_matrix",
    "precondition",
    "trainable_bias",
    "write_gradient_matrix",
]


class GradientAccess(Protocol):
    """How a parameter's gradient is read and written: where it lives is the parameter
    layout's business (:mod:`spdkfac.layout`), not the layer math's."""

    def read(self, param: Tensor) -> Tensor | None:
        """The parameter's full gradient (None without one)."""
        ...

    def write(self, param: Tensor, value: Tensor) -> None:
        """Write ``value`` (the full gradient's shape) as the parameter's gradient."""
        ...


class LocalGradients:
    """Gradients where a plain or ``DistributedDataParallel`` model keeps them: each
    parameter's own full ``.grad``."""

    def read(self, param: Tensor) -> Tensor | None:
        return param.grad

    def write(self, param: Tensor, value: Tensor) -> None:
        assert param.grad is not None
        param.grad.copy_(value)


#: The gradient access of plain and DDP models.
LOCAL_GRADIENTS = LocalGradients()


def trainable_bias(module: nn.Module) -> bool:
    """Whether the module has a bias that is trained (``requires_grad``): a frozen bias is a
    constant of the layer, not a parameter of its curvature block."""
    bias = getattr(module, "bias", None)
    return isinstance(bias, Tensor) and bias.requires_grad


def gradient_matrix(weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
    """``[∇W.view(out, -1), ∇b]``: the layer gradient as an ``[out, in(+1)]`` matrix."""
    matrix = weight_grad.reshape(weight_grad.shape[0], -1)
    if bias_grad is None:
        return matrix
    return torch.cat([matrix, bias_grad.reshape(-1, 1)], dim=1)


def write_gradient_matrix(
    module: nn.Module,
    matrix: Tensor,
    access: GradientAccess = LOCAL_GRADIENTS,
    *,
    bias: bool = True,
) -> None:
    """Write an ``[out, in(+1)]`` matrix back as ``module.weight``'s and ``bias``'s
    gradients (the bias only where it has one, ``bias`` is True and it has a gradient)."""
    weight = module.weight
    assert isinstance(weight, Tensor)
    columns = weight.shape[1:].numel()  # not weight[0]: a collective on a DTensor
    access.write(weight, matrix[:, :columns].reshape(weight.shape))
    parameter = getattr(module, "bias", None)
    if not bias or matrix.shape[1] <= columns or not isinstance(parameter, Tensor):
        return
    # Whether the bias has a gradient, from ``.grad`` itself: reading it through
    # ``access`` would gather a sharded one only to test it for None.
    if parameter.grad is not None:
        access.write(parameter, matrix[:, columns])


def precondition(gradient: Tensor, a_inverse: Tensor, g_inverse: Tensor) -> Tensor:
    """``V = Ĝ ∇ Â`` for a gradient matrix ``∇`` of shape ``[out, in(+1)]``."""
    return g_inverse @ gradient @ a_inverse


class KFACLayer(ABC):
    """Stateless adapter from one ``nn.Module`` type to K-FAC's factor math.

    Implementations are pure: they read the module's configuration and the captured tensors
    and return new tensors; running averages and inverses live elsewhere.
    """

    #: Module types this adapter handles. The registry also accepts subclasses that keep
    #: the registered type's ``forward``; one with a custom forward is not assumed to keep
    #: the math.
    module_types: tuple[type[nn.Module], ...] = ()
    #: A is a diagonal kept as a ``[a_dim]`` vector (one-hot inputs: ``nn.Embedding``).
    diagonal_a: bool = False
    #: Whether A has the bias column, fixed for one module by :meth:`for_module` when its
    #: block is built (None: decided from the module at each call).
    bias_column: bool | None = None

    def supports(self, module: nn.Module) -> bool:
        """Whether this module's configuration is supported (e.g. Conv2d with groups=1)."""
        return True

    @abstractmethod
    def a_dim(self, module: nn.Module) -> int:
        """Side of the A factor: inputs per output unit, plus 1 with a bias."""

    @abstractmethod
    def g_dim(self, module: nn.Module) -> int:
        """Side of the G factor: output units."""

    @abstractmethod
    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        """The A factor of one forward call and its weight B (examples) for averaging calls."""

    @abstractmethod
    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        """The G factor of one backward call and its weight B (examples) for averaging calls."""

    def with_options(
        self, options: FactorOptions, *, weight_sharing: WeightSharing = "expand"
    ) -> KFACLayer:
        """This adapter computing its factors as ``options`` and ``weight_sharing`` say
        (self when it has no options)."""
        return self

    def for_module(self, module: nn.Module) -> KFACLayer:
        """This adapter with the bias column decided once, for ``module`` as it is now: its
        block's factor shapes then never change, whatever ``requires_grad`` becomes later."""
        bound = copy.copy(self)
        bound.bias_column = trainable_bias(module)
        return bound

    def has_bias(self, module: nn.Module) -> bool:
        """Whether the block has the bias column: the module has a *trainable* bias (as
        :meth:`for_module` found it). A frozen bias is left out of A and of the gradient
        matrix, so the weight's update is K-FAC of the trainable parameters only."""
        if self.bias_column is not None:
            return self.bias_column and isinstance(getattr(module, "bias", None), Tensor)
        return trainable_bias(module)

    def weight_rows(self, weight_grad: Tensor) -> Tensor:
        """The weight's gradient with the output units first (as stored, for most layers)."""
        return weight_grad

    def gradient(
        self, module: nn.Module, access: GradientAccess = LOCAL_GRADIENTS
    ) -> Tensor | None:
        """The ``[out, in(+1)]`` gradient matrix, or None when the weight has no gradient."""
        weight = module.weight
        assert isinstance(weight, Tensor)
        weight_grad = access.read(weight)
        if weight_grad is None:
            return None
        weight_grad = self.weight_rows(weight_grad)
        if not self.has_bias(module):
            return gradient_matrix(weight_grad, None)
        bias = module.bias
        assert isinstance(bias, Tensor)
        bias_grad = access.read(bias)
        # A bias frozen after construction reads as zeros of its full shape: a plain
        # tensor like the weight's gradient, also where the bias is a sharded DTensor.
        zeros = weight_grad.new_zeros(bias.shape) if bias_grad is None else None
        return gradient_matrix(weight_grad, bias_grad if zeros is None else zeros)

    def set_gradient(
        self, module: nn.Module, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS
    ) -> None:
        """Write a preconditioned ``[out, in(+1)]`` matrix back into the parameters."""
        write_gradient_matrix(module, matrix, access, bias=self.has_bias(module))

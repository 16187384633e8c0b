"""K-FAC factors for Hugging Face ``transformers``' ``Conv1D``: a Linear layer whose weight is
stored transposed.

GPT-2 (and GPT, CTRL, …) write their projections as ``Conv1D(nf, nx)``: ``y = x @ W + b``
with ``W`` of shape ``[in, out] = [nx, nf]`` — the ``nn.Linear`` of weight ``Wᵀ``. Its
factors are the Linear layer's (A over the inputs, G over the output gradients, the same
expand/reduce weight sharing over positions); only the gradient matrix is read and written
through the transpose: ``[∇Wᵀ, ∇b]`` of shape ``[out, in(+1)]``.

Nothing is imported from ``transformers``: the layer is recognised by its class name and
shape (:func:`is_transposed_linear`), so spdkfac needs no such dependency.
"""

from __future__ import annotations

from torch import Tensor, nn

from spdkfac.layers.base import LOCAL_GRADIENTS, GradientAccess
from spdkfac.layers.linear import LinearLayer
from spdkfac.layers.options import FactorOptions
from spdkfac.types import WeightSharing

__all__ = ["TransposedLinearLayer", "is_transposed_linear"]

#: Class names of ``x @ W + b`` layers with ``W`` stored ``[in, out]`` and ``nf`` outputs.
TRANSPOSED_LINEAR_NAMES = frozenset({"Conv1D"})


def _declaring_class(module: nn.Module) -> type | None:
    """The class named like a transposed linear layer whose ``forward`` the module runs
    (itself, or a base it inherits ``forward`` from unchanged)."""
    for cls in type(module).__mro__:
        if cls.__name__ in TRANSPOSED_LINEAR_NAMES and type(module).forward is getattr(
            cls, "forward", None
        ):
            return cls
    return None


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``Conv1D`` (by name and shape: a 2-D
    ``weight`` of ``nf`` columns, a ``[nf]`` bias or none)."""
    if _declaring_class(module) is None:
        return False
    weight, outputs = getattr(module, "weight", None), getattr(module, "nf", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != outputs:
        return False
    bias = getattr(module, "bias", None)
    return bias is None or (isinstance(bias, Tensor) and tuple(bias.shape) == (outputs,))


class TransposedLinearLayer(LinearLayer):
    """Adapter for ``transformers``' ``Conv1D`` (see the module docstring)."""

    module_types = ()

    def __init__(
        self, *, options: FactorOptions | None = None, weight_sharing: WeightSharing = "expand"
    ) -> None:
        super().__init__(options=options, weight_sharing=weight_sharing)

    def with_options(
        self, options: FactorOptions, *, weight_sharing: WeightSharing = "expand"
    ) -> TransposedLinearLayer:
        return TransposedLinearLayer(options=options, weight_sharing=weight_sharing)

    def supports(self, module: nn.Module) -> bool:
        return is_transposed_linear(module)

    def a_dim(self, module: nn.Module) -> int:
        weight = module.weight
        assert isinstance(weight, Tensor)
        return weight.shape[0] + int(self.has_bias(module))

    def g_dim(self, module: nn.Module) -> int:
        weight = module.weight
        assert isinstance(weight, Tensor)
        return weight.shape[1]

    def weight_rows(self, weight_grad: Tensor) -> Tensor:
        """``∇Wᵀ``: the ``[out, in]`` rows of the ``[in, out]`` stored weight's gradient."""
        return weight_grad.t()

    def set_gradient(
        self, module: nn.Module, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS
    ) -> None:
        """Write ``[∇Wᵀ, ∇b]`` back: the weight's gradient as ``[in, out]``."""
        weight = module.weight
        assert isinstance(weight, Tensor)
        inputs = weight.shape[0]
        access.write(weight, matrix[:, :inputs].t().contiguous())
        bias = getattr(module, "bias", None)
        if self.has_bias(module) and isinstance(bias, Tensor) and access.read(bias) is not None:
            access.write(bias, matrix[:, inputs])

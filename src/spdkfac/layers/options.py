"""Options of the factor computations: method, compute dtype, selection, examples read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = ["FactorMethod", "FactorOptions", "SelectionPolicy"]

FactorMethod = Literal["auto", "reference", "im2col", "correlation"]
SelectionPolicy = Literal["model", "measure"]


@dataclass(frozen=True, kw_only=True)
class FactorOptions:
    """How adapters compute factors; every method gives the DESIGN.md factor to float tolerance.

    Attributes:
        method: ``"auto"`` picks per Conv2d layer (see ``selection``); ``"reference"`` is
            ``F.unfold`` + ``aᵀa`` (and the reference G and Linear functions);
            ``"im2col"`` and ``"correlation"`` force a Conv2d A method (correlation falls
            back to im2col where it does not apply: stride ≠ 1, 1×1 kernels, and in
            bf16/fp16 windows covering under half the image). Linear factors and Conv2d G
            use one triangular Gram product unless ``"reference"``.
        compute_dtype: dtype of the products, e.g. ``torch.bfloat16`` (fp32 accumulation,
            output rounded once: about 2e-3 relative error per factor, see
            ``benchmarks/reports/factors_cpu.md``); None computes in the input's dtype.
            Results keep the input's dtype. Ignored for factors with no more rows than
            their side (rank-deficient: rounding would make ``F + γI`` indefinite).
            float16 is as accurate as its range allows (inputs are scaled by a power of
            two) but not faster than float32 on CPUs without fp16 matrix units.
        selection: ``"model"``: a deterministic cost model calibrated on a CPU (on other
            devices it picks im2col); ``"measure"``: time each candidate once per layer
            geometry and cache the fastest (ranks or runs may then pick differently,
            which changes results only by rounding).
        examples: Statistics from the first ``examples`` examples (leading dimension) of
            each captured call only, on each rank; None: all of them. The factors are
            then estimated from fewer examples (the running average smooths the noise,
            as Hessian-free optimization estimates curvature on a smaller mini-batch than
            the gradient, Martens 2010) at a fraction of the cost; the gradient still uses
            the whole batch. Output-gradient statistics are rescaled so that the estimate
            stays unbiased for a loss averaged over the whole batch.
    """

    method: FactorMethod = "auto"
    compute_dtype: torch.dtype | None = None
    selection: SelectionPolicy = "model"
    examples: int | None = None

    def __post_init__(self) -> None:
        if self.method not in get_args(FactorMethod):
            raise ValueError(f"method must be one of {get_args(FactorMethod)}, got {self.method!r}")
        if self.selection not in get_args(SelectionPolicy):
            raise ValueError(
                f"selection must be one of {get_args(SelectionPolicy)}, got {self.selection!r}"
            )
        examples = self.examples
        if examples is not None and (
            isinstance(examples, bool) or not isinstance(examples, int) or examples < 1
        ):
            raise ValueError(f"examples must be an int >= 1 or None, got {self.examples!r}")
        if self.compute_dtype is not None and (
            not isinstance(self.compute_dtype, torch.dtype)
            or not self.compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"compute_dtype must be a floating-point torch.dtype or None, "
                f"got {self.compute_dtype!r}"
            )

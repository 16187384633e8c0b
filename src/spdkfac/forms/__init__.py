"""What the inverse phase computes from a factor, and how a Kronecker block preconditions
with it: the *inverse form* chosen by the ``inverse_method`` option.

``"cholesky"`` / ``"eigen"`` — the damped inverse ``(F + γI)⁻¹`` of each factor (Martens
and Grosse 2015, Section 6.3 with the factored Tikhonov damping of Grosse and Martens
2016 reduced to one γ), kept and broadcast as a packed upper triangle; preconditioning is
``V = (G + γI)⁻¹ ∇ (A + γI)⁻¹``.

``"eigen-basis"`` — each factor's eigendecomposition ``F = Q diag(λ) Qᵀ`` (eigenvalues
clamped at 0), kept as one ``[d, d + 1]`` tensor ``[Q | λ]``; the damping is added to the
*Kronecker product's* eigenvalues (George et al. 2018, "Fast Approximate Natural Gradient
Descent in a Kronecker-factored Eigenbasis", Section 3; the eigen method of KAISA,
Pauloski et al. 2021, Section 3): ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``, the
exact ``(A ⊗ G + γI)⁻¹`` applied to ∇. It damps every direction by γ alone (the inverse
form damps by about γ·(λ_A + λ_G)), costs two more products per step and travels as
``d² + d`` elements instead of ``d(d + 1)/2``.

``"eigen-adam"`` — eigenvalue-corrected K-FAC with Adam's moments: the same eigen-bases,
with the Kronecker eigenvalues replaced by a running second moment of the gradient in
that basis, as SOAP does with Shampoo's factors (Vyas et al. 2024, "SOAP: Improving and
Stabilizing Shampoo using Adam", Algorithm 3; EK-FAC, George et al. 2018, Section 3.2, for
the correction itself): per layer, ``m ← β₁m + (1-β₁)∇`` in the parameters' space,
``∇' = Q_Gᵀ ∇ Q_A``, ``v ← β₂v + (1-β₂)∇'²``, and the direction is
``Q_G [(Q_Gᵀ m Q_A / (1-β₁ᵗ)) / (√(v / (1-β₂ᵗ)) + ε)] Q_Aᵀ`` (β₁ = β₂ = 0.95, ε = 1e-8:
SOAP's defaults). The bases refresh on the inverse interval; the moments are kept across a
refresh (``m`` lives in the parameters' space; ``v`` stays as it is, the eigenvalues come
in ascending order each time, as SOAP keeps it). The moments are the block's state, kept
by whoever preconditions (every rank, or the owner) and saved in state dicts. It is a full
update direction (momentum and scale included): step it with a plain optimizer such as
``torch.optim.SGD`` without momentum (its ``weight_decay`` then is AdamW's decoupled
decay), and without the KL clip. ``damping`` plays no part in it. Well posed on
rank-deficient factors: the per-coordinate ``v`` divides only coordinates whose
eigenvalues both factors resolve (above ``√d·ε·λ_max``, ``ε`` the epsilon of the coarsest
stored precision: Weyl's bound on rounding); the others — a null space whose basis
``eigh`` picks arbitrarily — are divided by ``√mean(v̂)`` of the layer, which no rotation
changes, and share one stored ``v`` (their mean), so nothing of the arbitrary basis
survives a refresh (see :class:`~spdkfac.forms.eigen.EigenAdam`).

``"one-sided"`` — only A's damped inverse, on the right: ``V = ∇ (A + γ·tr(A)/d·I)⁻¹``
(the damping is relative to A's mean eigenvalue, so it does not depend on the
activations' scale); G is neither captured nor inverted. Composed with
``torch.optim.Muon``, whose orthogonalization sets the scale, it is Newton-Muon (Du and Su
2026: Muon of ``G (ZZᵀ)⁻¹``). Only layers with a dense A take it (Linear, convolutions
with one group, Hugging Face's Conv1D); embeddings and grouped convolutions are left to
the optimizer (named in the "not preconditioned" warning).

Any form may be *grafted* (the ``grafting`` option, :mod:`spdkfac.forms.graft`): its
direction with SGD's or Adam's step size per layer.

Results are stored in ``dtype`` (the ``inverse_dtype`` option; decompositions always run
in at least float32) and applied in the gradient's dtype (promoted with theirs).

**Costs.** Each form states what one result costs, so the placement planners, the cost
model's predictions and the simulator price it as the run computes and sends it:
:meth:`InverseForm.wire_size` (elements in a broadcast) and
:attr:`InverseForm.compute_scale`, its compute time relative to the cost model's one
inverse-time curve (:class:`~spdkfac.costmodel.PolynomialInverseModel`), which is fitted
to damped inverses by Cholesky (the default cost model, and ``spdkfac calibrate``'s default
``--method cholesky``). The scales (:data:`COMPUTE_SCALES`) were measured on a 2-core
AMD EPYC (torch 2.13, one thread; ``benchmarks/sim/measure_sim_form_costs.py``, report in
``benchmarks/reports/form_costs_cpu.md``):
over d = 384…2048 a clamped ``eigh`` plus the reconstruction ``Q diag(1/(λ+γ)) Qᵀ`` took
4.2-5.7x a Cholesky inverse, the ``eigh`` of the eigen-basis alone 3.4-4.8x (two runs;
the scales are their middles); below d ≈ 128, where the per-call floor dominates, both
are nearer 2.5-3.6x. They are CPU
figures, not measured on a GPU (the simulator's GPU presets use them as they are). A cost
model calibrated with ``--method eigen`` already prices an eigendecomposition, so these
scales over-price it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spdkfac.forms.base import COMPUTE_SCALES, FORM_METHODS, FormMethod, InverseForm, Moments
from spdkfac.forms.eigen import EigenAdam, EigenBasis
from spdkfac.forms.graft import GRAFTINGS, Grafted, GraftingName
from spdkfac.forms.inverses import DampedInverse, OneSided

__all__ = [
    "COMPUTE_SCALES",
    "FORM_METHODS",
    "GRAFTINGS",
    "DampedInverse",
    "EigenAdam",
    "EigenBasis",
    "FormMethod",
    "Grafted",
    "GraftingName",
    "InverseForm",
    "Moments",
    "OneSided",
    "inverse_form",
]

#: Each method's form from the results' and the factors' storage dtypes.
_FORMS: dict[str, Callable[[torch.dtype | None, torch.dtype | None], InverseForm]] = {
    "cholesky": lambda dtype, _: DampedInverse("cholesky", dtype),
    "eigen": lambda dtype, _: DampedInverse("eigen", dtype),
    "eigen-basis": lambda dtype, _: EigenBasis(dtype),
    "eigen-adam": EigenAdam,
    "one-sided": lambda dtype, _: OneSided(dtype),
}


def inverse_form(
    method: str,
    dtype: torch.dtype | None = None,
    grafting: str | None = None,
    factor_dtype: torch.dtype | None = None,
) -> InverseForm:
    """The form of an ``inverse_method`` value, storing results in ``dtype``, grafted
    (:class:`Grafted`) unless ``grafting`` is None; ``factor_dtype`` (the factors'
    storage dtype, None: float32) sets ``"eigen-adam"``'s eigenvalue resolution.

    Raises:
        ValueError: An unknown method or grafting.
    """
    if method not in _FORMS:
        raise ValueError(f"inverse_method must be one of {FORM_METHODS}, got {method!r}")
    form = _FORMS[method](dtype, factor_dtype)
    return form if grafting is None else Grafted(form, grafting)

"""The cost model a benchmark plans with: a calibration file, or fitted on the live link."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from spdkfac.calibrate import measure_collectives, measure_inverses
from spdkfac.calibrate.timing import median_seconds
from spdkfac.comm import Communicator
from spdkfac.costmodel import AlphaBetaModel, CostModel, PolynomialInverseModel
from spdkfac.curvature import discover_layers
from spdkfac.linalg import all_finite, packed_size

__all__ = [
    "MESSAGE_SIZES",
    "describe_cost_model",
    "factor_dims",
    "fit_live_cost_model",
    "read_cost_model",
    "unpack_seconds",
]

#: Message sizes (bytes) timed on the live link: start-up dominated to bandwidth dominated.
MESSAGE_SIZES: tuple[int, ...] = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _all_dims(model: nn.Module) -> list[int]:
    with warnings.catch_warnings():  # the preconditioners warn about skipped layers
        warnings.simplefilter("ignore")
        layers = discover_layers(model, ())
    return [d for state in layers.values() for d in (state.a_dim, state.g_dim)]


def factor_dims(model: nn.Module) -> list[int]:
    """The distinct dimensions of the model's K-FAC factors, ascending."""
    return sorted(set(_all_dims(model)))


def unpack_seconds(model: nn.Module, repeats: int = 3) -> float:
    """Host time the factor exchange spends per step on the reduced factors.

    After the all-reduce, every factor's packed triangle is divided by its weight (into a
    new tensor) and the results are checked for finiteness inside the exchange's
    ``wait()`` (:meth:`~spdkfac.comm.exchange.FactorExchange.result`), so the profiler
    counts that compute as ``FactorComm``; no fusion policy can hide it. This times the
    same operations on every factor of the model (median of ``repeats``), for the report to
    subtract. (The name is older than packed running factors: the exchange used to unpack
    every factor here.)
    """
    cpu = torch.device("cpu")
    packed = [torch.ones(packed_size(dim)) for dim in _all_dims(model)]

    def scale_and_check() -> None:
        all_finite([triangle.div(1.0) for triangle in packed])

    return median_seconds(scale_and_check, repeats, cpu)


def fit_live_cost_model(
    comm: Communicator,
    dims: Sequence[int],
    *,
    repeats: int = 5,
    sizes: Sequence[int] = MESSAGE_SIZES,
) -> CostModel:
    """Inverse times fitted on ``dims`` and broadcast / all-reduce α-β fitted on this link.

    A collective: every rank must call it. Inversions are timed on every rank at once, as
    in training; each rank fits its own model, and the preconditioner plans with rank 0's.
    With one rank, communication costs are zero.
    """
    inverse = PolynomialInverseModel.fit(measure_inverses(dims, repeats, damping=3e-3))
    if comm.world_size == 1:
        zero = AlphaBetaModel(alpha=0.0, beta=0.0)
        return CostModel(inverse=inverse, broadcast=zero, allreduce=zero)
    samples = measure_collectives(comm, sizes, repeats)
    return CostModel(
        inverse=inverse,
        broadcast=AlphaBetaModel.fit(samples.broadcast),
        allreduce=AlphaBetaModel.fit(samples.allreduce),
    )


def _alpha_beta(model: AlphaBetaModel) -> str:
    bandwidth = f"{1e-9 / model.beta:.3f} GB/s" if model.beta > 0 else "inf"
    return f"α {1e3 * model.alpha:.3f} ms, β {1e9 * model.beta:.3f} ns/B ({bandwidth})"


def describe_cost_model(model: CostModel, source: str) -> dict[str, Any]:
    """The numbers the report prints (rank 0's model, the one every rank plans with)."""
    inverse = model.inverse
    return {
        "source": source,
        "inverse": f"t(d) = {inverse.c0:.3g} + {inverse.c2:.3g}·d² + {inverse.c3:.3g}·d³ s",
        "broadcast": _alpha_beta(model.broadcast),
        "all-reduce": _alpha_beta(model.allreduce),
    }


_FLOAT = r"([0-9.]+(?:e[-+]?[0-9]+)?)"


def _read(pattern: str, text: object, what: str) -> list[float]:
    match = re.search(pattern, str(text))
    if match is None:
        raise ValueError(f"cannot parse the {what} {text!r}")
    return [float(value) for value in match.groups()]


def read_cost_model(described: Mapping[str, Any]) -> CostModel:
    """The cost model :func:`describe_cost_model` printed (to its printed precision), e.g.
    from a committed ``results.json``.

    Raises:
        ValueError: Naming an entry that is not in the printed form.
    """
    c0, c2, c3 = _read(
        rf"=\s*{_FLOAT}\s*\+\s*{_FLOAT}·d²\s*\+\s*{_FLOAT}·d³",
        described["inverse"],
        "inverse model",
    )

    def alpha_beta(key: str) -> AlphaBetaModel:
        alpha, beta = _read(
            rf"α\s*{_FLOAT}\s*ms,\s*β\s*{_FLOAT}\s*ns/B", described[key], f"{key} model"
        )
        return AlphaBetaModel(alpha=alpha * 1e-3, beta=beta * 1e-9)

    return CostModel(
        inverse=PolynomialInverseModel(c0=c0, c2=c2, c3=c3),
        broadcast=alpha_beta("broadcast"),
        allreduce=alpha_beta("all-reduce"),
    )

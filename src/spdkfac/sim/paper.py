"""The SPD-KFAC paper's cluster: its reported numbers and how the ``paper`` preset is fitted.

The paper (Shi, Zhang, Li 2021, "Accelerating Distributed K-FAC with Smart Parallelism of
Computing and Communication Tasks", Sec. VI and its Table I) ran 64 RTX2080Ti GPUs (16
nodes × 4, 100 Gb/s InfiniBand) and models an all-reduce of m elements as ``α + β·m``
(its Eq. 14, fitted in its Fig. 7); the authors' public code uses ``α = 9.29e-4 s``,
``β = 1.4335e-9 s/element``. It gives no GPU compute rates, so
:func:`derive_paper_hardware` fits them to the paper's own ResNet-50 (batch 32, 64
workers) D-KFAC breakdown (its Fig. 9):

* traced ops: one GEMM rate such that simulated FF&BP = 0.132 s, with an *assumed*
  memory bandwidth of 460 GB/s (75 % of the 2080 Ti's 616 GB/s) and 8 µs per op;
* factors: one FLOP rate for A and G products such that simulated FactorComp = 0.2115 s
  (0.4083 − 0.1968), with an *assumed* 0.1 ms per product (about ten small kernels);
* inverses: ``t(d) = c0 + c3·d³`` such that inverting all 108 factors takes 0.274 s
  (Non-Dist) and the slowest rank of the round-robin placement 0.051 s (Seq-Dist compute);
* broadcast (not in the paper): the all-reduce α with half its β, since a ring broadcast
  moves each byte over each link once where a ring all-reduce moves it twice.

Those four ResNet-50 numbers are therefore calibration, not validation. Everything else
(GradComm, FactorComm, inverse communication, MPD-KFAC and SPD-KFAC, ResNet-152,
DenseNet-201) is predicted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Final

import numpy as np

from spdkfac.costmodel import (
    AlphaBetaModel,
    FactorTimeModel,
    FlopRateModel,
    PolynomialInverseModel,
)
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.hardware import CommunicationModel, DeviceModel, Hardware
from spdkfac.sim.simulator import simulate_strategy
from spdkfac.sim.workload import Workload

__all__ = [
    "PAPER_ALLREDUCE",
    "PAPER_BROADCAST",
    "PAPER_RESNET50",
    "PAPER_RESNET152_INVERSE",
    "PAPER_TABLE_III",
    "derive_paper_hardware",
    "fit_paper_overlap",
    "paper_inverse_model",
]

#: Table III: iteration seconds (D-KFAC, MPD-KFAC, SPD-KFAC) at 64 workers, with batch.
PAPER_TABLE_III: Final[dict[str, tuple[int, float, float, float]]] = {
    "resnet50": (32, 0.8525, 0.7635, 0.6755),
    "resnet152": (8, 1.5807, 1.3933, 1.1689),
    "densenet201": (16, 1.4964, 1.5340, 1.3615),
}
#: ResNet-50 numbers of the paper's Sec. VI (seconds per iteration): the Fig. 9 time
#: breakdown (cumulative bars) and the Fig. 12 inverse phase, as the authors' plotting
#: script gives them.
PAPER_RESNET50: Final[dict[str, float]] = {
    "FF&BP": 0.132,
    "GradComm": 0.1968 - 0.132,
    "FactorComp": 0.4083 - 0.1968,
    "FactorComm d-kfac": 0.5783 - 0.4083,
    "FactorComm spd-kfac": 0.5064 - 0.4083,
    "inverse non-dist": 0.274,
    "inverse seq-dist compute": 0.051,
    "inverse seq-dist total": 0.185,
    "inverse lbp compute": 0.105,
    "inverse lbp total": 0.169,
}
#: Fig. 12 for ResNet-152: (compute, compute + communication) of the inverse phase.
PAPER_RESNET152_INVERSE: Final[dict[str, tuple[float, float]]] = {
    "non-dist": (0.676, 0.676),
    "seq-dist": (0.054, 0.492),
    "lbp": (0.281, 0.427),
}
_ELEMENT = 4
PAPER_ALLREDUCE: Final = AlphaBetaModel(alpha=9.29e-4, beta=1.4335e-9 / _ELEMENT)
PAPER_BROADCAST: Final = AlphaBetaModel(alpha=9.29e-4, beta=1.4335e-9 / _ELEMENT / 2)
_WORKERS = 64
_MEMORY_BYTES_PER_SECOND = 460e9
_OP_OVERHEAD = 8e-6
_FACTOR_OVERHEAD = 1e-4


def paper_inverse_model(dims: list[int], world_size: int = _WORKERS) -> PolynomialInverseModel:
    """``c0 + c3·d³`` through Non-Dist = 0.274 s and the round-robin maximum = 0.051 s.

    Every rank is tried as the slowest one; the solution whose slowest rank is the one
    assumed (and whose coefficients are >= 0) is returned.
    """
    count, cubes = [0] * world_size, [0.0] * world_size
    for index, dim in enumerate(dims):
        count[index % world_size] += 1
        cubes[index % world_size] += float(dim) ** 3
    total = np.array([len(dims), sum(float(d) ** 3 for d in dims)])
    targets = np.array(
        [PAPER_RESNET50["inverse non-dist"], PAPER_RESNET50["inverse seq-dist compute"]]
    )
    for rank in range(world_size):
        c0, c3 = np.linalg.solve(np.array([total, [count[rank], cubes[rank]]]), targets)
        if c0 < 0 or c3 < 0:
            continue
        slowest = max(c0 * n + c3 * s for n, s in zip(count, cubes, strict=True))
        if slowest <= targets[1] * (1 + 1e-9):
            return PolynomialInverseModel(c0=float(c0), c2=0.0, c3=float(c3))
    raise ValueError("no non-negative c0, c3 reproduces the paper's inverse numbers")


def _bisect(measure: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The rate in [low, high] (log scale) where ``measure`` (decreasing) hits ``target``."""
    for _ in range(60):
        middle = float(np.sqrt(low * high))
        if measure(middle) > target:
            low = middle
        else:
            high = middle
    return float(np.sqrt(low * high))


def derive_paper_hardware(resnet50: Workload) -> Hardware:
    """Fit the ``paper`` preset to the ResNet-50 (batch 32) breakdown (module docstring)."""
    if resnet50.batch_size != 32:
        raise ValueError(f"the paper's ResNet-50 ran batch 32, got {resnet50.batch_size}")
    dims = [d for layer in resnet50.layers for d in (layer.a_dim, layer.g_dim)]
    hardware = Hardware(
        name="paper",
        description="SPD-KFAC paper cluster: 64x RTX2080Ti, 100 Gb/s InfiniBand",
        device=DeviceModel(
            gemm_flops_per_second=1e13,
            memory_bytes_per_second=_MEMORY_BYTES_PER_SECOND,
            op_overhead_seconds=_OP_OVERHEAD,
        ),
        factor=FactorTimeModel(
            a_rate=FlopRateModel(1e13, _FACTOR_OVERHEAD),
            g_rate=FlopRateModel(1e13, _FACTOR_OVERHEAD),
        ),
        inverse=paper_inverse_model(dims),
        communication=CommunicationModel({_WORKERS: (PAPER_BROADCAST, PAPER_ALLREDUCE)}),
        broadcast_buffers=False,  # Horovod keeps buffers local
    )

    def with_gemm(rate: float) -> Hardware:
        return replace(hardware, device=replace(hardware.device, gemm_flops_per_second=rate))

    ops = resnet50.ops()

    def ffbp(rate: float) -> float:  # what the simulated FF&BP category adds up
        device = with_gemm(rate).device
        return sum(device.op_seconds(op) for op in ops)

    hardware = with_gemm(_bisect(ffbp, PAPER_RESNET50["FF&BP"], 1e11, 1e15))
    # FactorComp = Σ (overhead + flops / rate) + packing + running averages: linear in
    # 1/rate, so solve it directly.
    costs = WorkloadCosts(resnet50, hardware, _WORKERS)
    fixed = sum(costs.factor(layer, kind) for layer in resnet50.layers for kind in ("A", "G"))
    fixed += costs.running_average()
    flops = sum(layer.a_flops + layer.g_flops for layer in resnet50.layers)
    fixed -= flops / 1e13  # the placeholder rate's share
    rate = flops / (PAPER_RESNET50["FactorComp"] - fixed)
    line = FlopRateModel(rate, _FACTOR_OVERHEAD)
    return replace(hardware, factor=FactorTimeModel(a_rate=line, g_rate=line))


def fit_paper_overlap(resnet50: Workload, hardware: Hardware) -> float:
    """The ``overlap`` at which simulated SPD-KFAC on ResNet-50 exposes the paper's 98 ms of
    factor communication (Fig. 10, "SP + optimal").

    The α-β model alone lets pipelined all-reduces overlap computation completely; the
    paper's runtime did not (its layer-wise pipelining exposed 206 ms, about all that 108
    separate all-reduces cost). This single number says how much of the link a collective
    kept while the GPUs computed. Fitting it uses one more ResNet-50 number; ResNet-152
    and DenseNet-201 stay predictions.
    """
    target = PAPER_RESNET50["FactorComm spd-kfac"]
    low, high = 0.0, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        trial = replace(hardware, overlap=middle)
        exposed = simulate_strategy(resnet50, trial, _WORKERS, "spd-kfac").breakdown["FactorComm"]
        if exposed > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2

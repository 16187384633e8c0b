"""Named hardware presets: this project's CPU machine, the SPD-KFAC paper's GPU cluster, and
the paper's GPUs on other networks.

``cpu``: the 2-core x86_64 VM the project is developed on, one torch thread per rank,
gloo on loopback. Inverse, factor-product lines and the 2-rank collectives are the fits of
``benchmarks/reports/costmodel_cpu.json`` and ``costmodel_cpu_2ranks.json`` (``spdkfac
calibrate``); the roofline of forward/backward ops, the bookkeeping primitives and the
host overheads were measured by ``benchmarks/sim/calibrate_sim_cpu.py``
(``benchmarks/reports/sim_cpu_preset.md``), the interference of gloo with computation by
``benchmarks/sim/calibrate_sim_interference.py``. Other world sizes scale the 2-rank
collectives as a ring all-reduce and a tree broadcast. For a model you can run here,
``--measured`` (``benchmarks/sim/measure_sim_compute.py``) replaces the roofline by its own
per-op times.

``paper``: RTX2080Ti GPUs, 4 per node, over 100 Gb/s InfiniBand; compute rates fitted to
the paper's ResNet-50 breakdown by :func:`spdkfac.sim.paper.derive_paper_hardware` (see
that module for what is assumed and what is calibration). Its collectives are the paper's
α-β lines at 64 GPUs and follow a ring across the 4-GPU nodes at other world sizes
(:mod:`spdkfac.sim.clusters`). ``paper-nccl``, ``ib100``, ``ib200``, ``ib400``, ``eth10``:
the same GPUs on the other networks of :data:`~spdkfac.sim.clusters.NETWORKS`.

There is no GPU preset measured on our own hardware: no GPU was available when the
simulator was written. ``spdkfac simulate --cost-model PATH`` replaces a preset's inverse,
collectives and factor times with a calibration file's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

from spdkfac.costmodel import (
    AlphaBetaModel,
    CalibrationFile,
    FactorTimeModel,
    FlopRateModel,
    PolynomialInverseModel,
)
from spdkfac.sim.clusters import NETWORKS
from spdkfac.sim.hardware import CommunicationModel, DeviceModel, Hardware

__all__ = ["PRESETS", "cluster_preset", "cpu_preset", "paper_preset", "resolve_hardware"]


# Measured by benchmarks/sim/calibrate_sim_cpu.py with two processes at once, one thread each
# (benchmarks/reports/sim_cpu_preset.md).
CPU_GEMM_FLOPS = 1.133e11
CPU_GEMM_HALF_SIDE = 0.0
CPU_MEMORY_BYTES = 1.763e10
CPU_OP_OVERHEAD = 9.784e-05
CPU_OP_SCALE = {
    "aten.convolution": 0.976,
    "aten.convolution_backward": 1.18,
    "aten.div": 2.94,
    "aten.native_batch_norm": 4.35,
    "aten.native_batch_norm_backward": 2.16,
    "aten.relu_": 0.485,
    "aten.threshold_backward": 1.5,
}
CPU_BOOKKEEPING = {
    "average": (2.98e-06, 2.56e-10),
    "copy": (6.8e-07, 1.06e-10),
    "dot": (2.34e-06, 2.36e-10),
    "finite_all": (5.74e-06, 2.86e-09),
    "finite_sum": (6.09e-06, 6.91e-10),
    "matmul": (2.88e-06, 6.58e-12),
    "pack": (2.23e-06, 6.86e-10),
    "scale": (2.3e-06, 2.73e-10),
    "sgd": (1.09e-05, 1.04e-09),
    "unpack": (4.7e-06, 1.83e-09),
}
CPU_HOOK_OVERHEAD = 8.373e-05
CPU_LAYER_STEP_OVERHEAD = 4.394e-05
CPU_ITERATION_OVERHEAD = 0.0
# benchmarks/sim/calibrate_sim_interference.py --link loopback
# (benchmarks/reports/sim_interference_cpu.json; means of 31 rounds, standard errors
# 0.02-0.03; an earlier 7-round median-based measurement gave 0.71 / 0.32). Its
# contention spread (0.33) is left out: drift between ranks makes every simulation draw
# many iterations (a profile, --profiled, brings its own).
CPU_OVERLAP = 0.51
CPU_CONTENTION = 0.39
CPU_BROADCAST_OVERLAP = 0.57
CPU_BROADCAST_CONTENTION = 0.37
CPU_ISSUE_OVERHEAD = 0.000114


def cpu_preset() -> Hardware:
    """This project's 2-core CPU machine (see the module docstring)."""
    return Hardware(
        name="cpu",
        description="2-core x86_64 VM, 1 torch thread per rank, gloo",
        device=DeviceModel(
            gemm_flops_per_second=CPU_GEMM_FLOPS,
            gemm_half_side=CPU_GEMM_HALF_SIDE,
            memory_bytes_per_second=CPU_MEMORY_BYTES,
            op_overhead_seconds=CPU_OP_OVERHEAD,
            op_scale=CPU_OP_SCALE,
        ),
        # benchmarks/reports/costmodel_cpu.json (spdkfac calibrate --model resnet32)
        factor=FactorTimeModel(
            a_rate=FlopRateModel(397.6e9, 9.41e-5), g_rate=FlopRateModel(79.2e9, 2.46e-5)
        ),
        inverse=PolynomialInverseModel(c0=6.87e-5, c2=6.66e-9, c3=1.574e-11),
        # benchmarks/reports/costmodel_cpu_2ranks.json (gloo on loopback)
        communication=CommunicationModel(
            {
                2: (
                    AlphaBetaModel(alpha=2.09e-4, beta=3.35e-10),
                    AlphaBetaModel(alpha=3.25e-4, beta=7.35e-10),
                )
            },
            scaling="ring",
        ),
        bookkeeping=CPU_BOOKKEEPING,
        hook_overhead_seconds=CPU_HOOK_OVERHEAD,
        issue_overhead_seconds=CPU_ISSUE_OVERHEAD,
        overlap=CPU_OVERLAP,
        contention=CPU_CONTENTION,
        broadcast_overlap=CPU_BROADCAST_OVERLAP,
        broadcast_contention=CPU_BROADCAST_CONTENTION,
        layer_step_overhead_seconds=CPU_LAYER_STEP_OVERHEAD,
        iteration_overhead_seconds=CPU_ITERATION_OVERHEAD,
    )


PAPER_GEMM_FLOPS = 8.690e12
PAPER_FACTOR_FLOPS = 8.921e12
PAPER_INVERSE_C0 = 4.209e-4
PAPER_INVERSE_C3 = 5.047e-13


def paper_preset() -> Hardware:
    """The SPD-KFAC paper's 64-GPU cluster (see :mod:`spdkfac.sim.paper`).

    The constants are :func:`~spdkfac.sim.paper.derive_paper_hardware` on ResNet-50 at
    batch 32, rounded to four digits (``tests/sim/test_presets.py`` re-derives them). Its
    network is :data:`~spdkfac.sim.clusters.NETWORKS` ``["paper"]``: the paper's own α-β
    lines at 64 GPUs, a ring across 4-GPU nodes elsewhere.
    """
    return replace(
        cluster_preset("paper"),
        name="paper",
        description="SPD-KFAC paper cluster: RTX2080Ti, 4 per node, 100 Gb/s InfiniBand",
    )


def cluster_preset(network: str) -> Hardware:
    """The paper's GPUs (RTX 2080 Ti compute fitted to its ResNet-50 breakdown) on the
    named network of :data:`~spdkfac.sim.clusters.NETWORKS`.

    Only the network differs between these presets: they answer "what would the paper's
    workers do on that cluster", not how faster GPUs would fare.
    """
    factor = FlopRateModel(PAPER_FACTOR_FLOPS, 1e-4)
    model = NETWORKS[network]
    return Hardware(
        name=network,
        description=f"RTX2080Ti compute (SPD-KFAC paper fit); {model.description}",
        device=DeviceModel(
            gemm_flops_per_second=PAPER_GEMM_FLOPS,
            memory_bytes_per_second=460e9,
            op_overhead_seconds=8e-6,
        ),
        factor=FactorTimeModel(a_rate=factor, g_rate=factor),
        inverse=PolynomialInverseModel(c0=PAPER_INVERSE_C0, c2=0.0, c3=PAPER_INVERSE_C3),
        communication=model,
        broadcast_buffers=False,  # Horovod keeps buffers local
    )


#: Preset name → builder: ``cpu``, ``paper``, and the paper's GPUs on every other network
#: of :data:`~spdkfac.sim.clusters.NETWORKS`.
PRESETS: dict[str, Callable[[], Hardware]] = {
    "cpu": cpu_preset,
    "paper": paper_preset,
    **{name: partial(cluster_preset, name) for name in NETWORKS if name != "paper"},
}


def resolve_hardware(preset: str, cost_model: str | None = None) -> Hardware:
    """The preset called ``preset``, with a calibration file's costs when one is given.

    Raises:
        ValueError: An unknown preset or a malformed calibration file.
        FileNotFoundError: A missing calibration file.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    hardware = PRESETS[preset]()
    if cost_model is not None:
        hardware = hardware.with_calibration(CalibrationFile.load(cost_model), source=cost_model)
    return hardware

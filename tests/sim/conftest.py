"""A hand-made two-layer workload and hardware with round numbers, for hand-checked timelines."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spdkfac.costmodel import (
    AlphaBetaModel,
    FactorTimeModel,
    FlopRateModel,
    PolynomialInverseModel,
)
from spdkfac.sim import (
    CommunicationModel,
    DeviceModel,
    FactorHook,
    GradReady,
    Hardware,
    LayerSpec,
    Op,
    Workload,
)

_HUGE = 1e30  # rates that make bookkeeping (memory traffic, factor FLOPs) cost ~0


def _op(flops: float) -> Op:
    return Op("aten.mm", flops, 0.0)


@pytest.fixture
def two_layers() -> Workload:
    """fc1 -> fc2 -> loss; every factor 2x2 (3 packed elements = 12 bytes).

    With ``round_hardware`` (1 MFLOP/s): forward fc1 1000 µs, fc2 1000 µs, loss 500 µs;
    backward loss 500 µs, fc2 2000 µs, fc1 2000 µs; 4 + 4 parameters (16 + 16 bytes).
    """
    return Workload(
        model="two-layers",
        batch_size=4,
        input_shape=(2,),
        layers=(
            LayerSpec("fc1", "linear", a_dim=2, g_dim=2, rows=4),
            LayerSpec("fc2", "linear", a_dim=2, g_dim=2, rows=4),
        ),
        forward=(
            FactorHook("A", "fc1"),
            _op(1000),
            FactorHook("A", "fc2"),
            _op(1000),
            _op(500),
        ),
        backward=(
            _op(500),
            FactorHook("G", "fc2"),
            _op(2000),
            GradReady("fc2.weight", 4),
            FactorHook("G", "fc1"),
            _op(2000),
            GradReady("fc1.weight", 4),
        ),
        parameters=(("fc1.weight", 4), ("fc2.weight", 4)),
    )


def make_hardware(
    *,
    allreduce: tuple[float, float] = (1e-3, 1e-5),
    broadcast: tuple[float, float] = (5e-4, 1e-5),
    world_size: int = 2,
) -> Hardware:
    """1 MFLOP/s GEMMs (1 FLOP = 1 µs), free memory traffic and overheads, A products
    100 µs, G products 200 µs, every inverse 300 µs; α (s) and β (s/byte) as given."""
    return Hardware(
        name="round",
        description="round numbers",
        device=DeviceModel(
            gemm_flops_per_second=1e6, memory_bytes_per_second=_HUGE, op_overhead_seconds=0.0
        ),
        factor=FactorTimeModel(
            a_rate=FlopRateModel(_HUGE, 1e-4), g_rate=FlopRateModel(_HUGE, 2e-4)
        ),
        inverse=PolynomialInverseModel(c0=3e-4, c2=0.0, c3=0.0),
        communication=CommunicationModel(
            {
                world_size: (
                    AlphaBetaModel(alpha=broadcast[0], beta=broadcast[1]),
                    AlphaBetaModel(alpha=allreduce[0], beta=allreduce[1]),
                )
            }
        ),
    )


@pytest.fixture
def round_hardware() -> Hardware:
    """:func:`make_hardware` with its defaults."""
    return make_hardware()


@pytest.fixture
def hardware_factory() -> Callable[..., Hardware]:
    """:func:`make_hardware` itself, for tests that need other α, β or world sizes."""
    return make_hardware

"""FSDP2's collectives and K-FAC's gradient gathers under FSDP2 (``spdkfac.sim.fsdp``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spdkfac.cli.main import main
from spdkfac.sim import CollectiveOp, Hardware, Workload, simulate_strategy
from spdkfac.sim.fsdp import fsdp_collectives, fsdp_result, simulate_fsdp, units

# round_hardware: all-gather and reduce-scatter are half the all-reduce line,
# α = 0.5 ms, β = 5 µs/byte; each two_layers unit is 4 float32 (16 bytes).
_UNIT_S = 5e-4 + 5e-6 * 16


def test_units_are_the_parameters_modules(two_layers: Workload) -> None:
    assert units(two_layers) == (("fc1", 4), ("fc2", 4))


def test_collectives_by_hand(two_layers: Workload, round_hardware: Hardware) -> None:
    collectives = fsdp_collectives(two_layers, round_hardware, 2)
    gather, scatter = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    assert [(c.label, c.op, c.nbytes, c.step) for c in collectives] == [
        ("forward all-gather fc1", gather, 16.0, False),
        ("backward all-gather fc1", gather, 16.0, False),
        ("grad reduce-scatter fc1", scatter, 16.0, False),
        ("forward all-gather fc2", gather, 16.0, False),
        ("backward all-gather fc2", gather, 16.0, False),
        ("grad reduce-scatter fc2", scatter, 16.0, False),
    ]
    for collective in collectives:
        assert collective.bytes_per_rank == 8.0  # (P-1)/P of the unit's 16 bytes
        assert collective.seconds == pytest.approx(_UNIT_S)
    kept = fsdp_collectives(two_layers, round_hardware, 2, reshard_after_forward=False)
    assert [c.label for c in kept] == [c.label for c in collectives if "backward" not in c.label]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_bytes_per_rank_are_the_parameters_share(
    two_layers: Workload, hardware_factory: Callable[..., Hardware], world_size: int
) -> None:
    hardware = hardware_factory(world_size=world_size)
    collectives = fsdp_collectives(two_layers, hardware, world_size)
    share = (world_size - 1) / world_size * 4.0 * two_layers.parameter_count
    for kind in ("forward all-gather", "backward all-gather", "grad reduce-scatter"):
        sent = sum(c.bytes_per_rank for c in collectives if c.label.startswith(kind))
        assert sent == pytest.approx(share)


def test_kfac_gathers_by_hand(two_layers: Workload, round_hardware: Hardware) -> None:
    for name in ("d-kfac", "spd-kfac", "mpd-kfac"):
        step = [c for c in fsdp_collectives(two_layers, round_hardware, 2, kfac=name) if c.step]
        assert [(c.label, c.op, c.nbytes) for c in step] == [
            ("grad all-gather fc1.weight", CollectiveOp.ALL_GATHER, 16.0),
            ("grad all-gather fc2.weight", CollectiveOp.ALL_GATHER, 16.0),
        ]
        assert [c.seconds for c in step] == pytest.approx([_UNIT_S, _UNIT_S])
    owner = [c for c in fsdp_collectives(two_layers, round_hardware, 2, kfac="osawa") if c.step]
    # each rank sends the layer whole in P chunks: a P·16-byte buffer
    assert [(c.label, c.op, c.nbytes, c.bytes_per_rank) for c in owner] == [
        ("owner scatter fc1", CollectiveOp.REDUCE_SCATTER, 32.0, 16.0),
        ("owner scatter fc2", CollectiveOp.REDUCE_SCATTER, 32.0, 16.0),
    ]
    assert [c.seconds for c in owner] == pytest.approx([5e-4 + 5e-6 * 32] * 2)
    assert not [c for c in fsdp_collectives(two_layers, round_hardware, 2, kfac="sgd") if c.step]
    assert fsdp_collectives(two_layers, round_hardware, 1, kfac="d-kfac") == ()


def test_iteration_by_hand(two_layers: Workload, round_hardware: Hardware) -> None:
    # Passes: the first all-gather exposed, the other five (2.9 ms) hidden by 7 ms of
    # compute; d-kfac's two gradient gathers exposed whole, in place of DDP's GradComm.
    result = simulate_fsdp(two_layers, round_hardware, 2, "d-kfac")
    ddp = simulate_strategy(two_layers, round_hardware, 2, "d-kfac")
    assert result.ddp == ddp
    assert result.pass_exposed_s == pytest.approx(_UNIT_S)
    assert result.step_comm_s == pytest.approx(2 * _UNIT_S)
    expected = ddp.iteration_s - ddp.breakdown["GradComm"] + 3 * _UNIT_S
    assert result.iteration_s == pytest.approx(expected)
    assert result.bytes_per_rank == pytest.approx(8 * 8.0)


@pytest.mark.parametrize("name", ["d-kfac", "spd-kfac", "mpd-kfac"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_kfac_costs_more_communication_than_under_ddp(
    two_layers: Workload, hardware_factory: Callable[..., Hardware], name: str, world_size: int
) -> None:
    hardware = hardware_factory(world_size=world_size)
    ddp = simulate_strategy(two_layers, hardware, world_size, name)
    collectives = fsdp_collectives(two_layers, hardware, world_size, kfac=name)
    grad_bytes = 4.0 * two_layers.parameter_count
    ddp_sent = 2 * (world_size - 1) / world_size * grad_bytes  # the ring all-reduce
    assert sum(c.bytes_per_rank for c in collectives) > ddp_sent
    allreduce = hardware.collective(CollectiveOp.ALL_REDUCE, world_size)
    ddp_seconds = ddp.grad_buckets * allreduce.predict(grad_bytes / ddp.grad_buckets)
    assert sum(c.seconds for c in collectives) > ddp_seconds
    step = sum(c.seconds for c in collectives if c.step)
    assert step > 0
    assert fsdp_result(ddp, two_layers, hardware).step_comm_s == pytest.approx(step)


def test_auto_is_refused(two_layers: Workload, round_hardware: Hardware) -> None:
    with pytest.raises(ValueError, match="strategy row"):
        simulate_fsdp(two_layers, round_hardware, 2, "auto")


_FLAGS = ["simulate", "--model", "resnet20", "--workers", "4", "--preset", "cpu"]
_FLAGS += ["--batch-size", "8", "--strategies", "sgd,d-kfac,osawa"]


def _report(capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert main([*_FLAGS, *extra]) == 0
    lines = capsys.readouterr().out.splitlines()
    return "\n".join(line for line in lines if not line.startswith("command:"))


def test_cli_without_the_option_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    plain = _report(capsys)
    assert _report(capsys, "--layout", "ddp") == plain
    assert "FSDP2" not in plain
    fsdp = _report(capsys, "--layout", "fsdp")
    assert "## FSDP2: resnet20, 4 workers" in fsdp
    for name in ("sgd", "d-kfac", "osawa"):
        assert any(line.startswith(f"| {name} |") for line in fsdp.splitlines())
    body = [line for line in fsdp.splitlines() if not line.startswith("layout:")]
    assert "\n".join(body).startswith(plain.rstrip("\n"))


def test_cli_refuses_auto_under_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*_FLAGS[:-1], "auto", "--layout", "fsdp"]
    assert main(flags) == 2
    assert "strategy row" in capsys.readouterr().err

"""Osawa et al.'s owner-computes strategy in the simulator: bytes, timeline, plan, memory."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from spdkfac.cli.main import main
from spdkfac.planning.final import REPLICATED
from spdkfac.planning.placement import (
    EVERY_RANK,
    FactorSpec,
    Plan,
    plan_inversions,
    plan_layer_owners,
)
from spdkfac.profiling import breakdown
from spdkfac.sim import (
    STRATEGY_TABLE,
    CollectiveOp,
    FactorHook,
    GradReady,
    Hardware,
    LayerSpec,
    Op,
    Workload,
    cpu_preset,
    rank_classes,
    simulate,
    simulate_strategy,
    workload_for,
)
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.owners import scatter_chunks
from spdkfac.sim.program import Collective
from spdkfac.sim.strategies import StrategySetup, factor_memory_bytes, prepare
from spdkfac.sim.timeline import build_iteration

OWNER_ROWS = ("osawa", "osawa-pipelined")


def _setup(workload: Workload, hardware: Hardware, world_size: int, name: str) -> StrategySetup:
    return prepare(WorkloadCosts(workload, hardware, world_size), STRATEGY_TABLE[name])


def _collectives(setup: StrategySetup) -> list[Collective]:
    return build_iteration(setup, factor_step=True, inverse_step=True)[1]


def _bytes(collectives: list[Collective]) -> dict[CollectiveOp, float]:
    totals: dict[CollectiveOp, float] = {}
    for collective in collectives:
        assert collective.op is not None
        totals[collective.op] = totals.get(collective.op, 0.0) + collective.nbytes
    return totals


def test_rows_are_owner_computes() -> None:
    for name in OWNER_ROWS:
        row = STRATEGY_TABLE[name]
        assert row.owner_computes and row.placement == "layer-owners"
    assert STRATEGY_TABLE["osawa-pipelined"].fusion is not None
    assert STRATEGY_TABLE["osawa-pipelined"].fusion.eager


def test_collectives_by_hand(two_layers: Workload, round_hardware: Hardware) -> None:
    # Two ranks, fc1 owned by 0 and fc2 by 1. Gradients: one DDP bucket [fc2.weight,
    # fc1.weight] of 4 + 4 floats, all owned: one 16-B reduce to each owner, in rank order.
    # Factors: D-KFAC's buckets [fc1/A, fc2/A] and [fc2/G, fc1/G], 3 packed floats
    # (12 B) per factor: per bucket a 12-B reduce to rank 0 then one to rank 1; the
    # weights 8·(2·2+1) = 40 B all-reduced as today; one 4-B flag agrees the owners'
    # factors are finite; the failure flags 4·2·2 = 16 B; the KL clip's sum, skip flag
    # and two layers' presence as 4 float64 (32 B); the gather one broadcast per owner of
    # its layer's 2·2 floats (16 B).
    setup = _setup(two_layers, round_hardware, 2, "osawa")
    assert dict(setup.layer_owners) == {"fc1": 0, "fc2": 1}
    collectives = _collectives(setup)
    RD, AR, BC = CollectiveOp.REDUCE, CollectiveOp.ALL_REDUCE, CollectiveOp.BROADCAST
    assert [(c.label, c.op, c.nbytes) for c in collectives] == [
        ("grad bucket 0 to 0", RD, 16.0),
        ("grad bucket 0 to 1", RD, 16.0),
        ("factor bucket 0 to 0", RD, 12.0),
        ("factor bucket 0 to 1", RD, 12.0),
        ("factor bucket 1 to 0", RD, 12.0),
        ("factor bucket 1 to 1", RD, 12.0),
        ("factor weights", AR, 40.0),
        ("factor finite flag", AR, 4.0),
        ("failure flags", AR, 16.0),
        ("kl clip sum", AR, 32.0),
        ("gather from 0", BC, 16.0),
        ("gather from 1", BC, 16.0),
    ]
    # A reduce is priced as the broadcast (500 µs + 10 µs/B), its own channel order kept.
    for c in collectives[:6]:
        assert (c.alpha, c.work) == pytest.approx((5e-4, 1e-5 * c.nbytes), rel=1e-12)
        assert c.channel == "default" and c.overlap is None and c.contention is None
    # A step that refreshes nothing: the gradients' reduces, the KL all-reduce (which
    # carries the skip flag: no separate one) and the gather.
    plain = build_iteration(setup, factor_step=False, inverse_step=False)[1]
    assert [c.label for c in plain] == [
        "grad bucket 0 to 0",
        "grad bucket 0 to 1",
        "kl clip sum",
        "gather from 0",
        "gather from 1",
    ]
    # The same bytes as SGD's and D-KFAC's buffers, split by owner: SGD all-reduces the
    # 32-B bucket; D-KFAC the two 24-B factor buckets too.
    sgd = _bytes(_collectives(_setup(two_layers, round_hardware, 2, "sgd")))
    d_kfac = _bytes(_collectives(_setup(two_layers, round_hardware, 2, "d-kfac")))
    assert sgd == {AR: 32.0}
    assert d_kfac == {AR: 32.0 + 48.0 + 40.0 + 16.0}
    assert _bytes(collectives) == {RD: 32.0 + 48.0, AR: 40.0 + 4.0 + 16.0 + 32.0, BC: 32.0}


def test_timeline_by_hand(two_layers: Workload, round_hardware: Hardware) -> None:
    # Round hardware: reduce = broadcast = 500 µs + 10 µs/B, all-reduce 1000 µs + 10 µs/B;
    # inverses 300 µs; preconditioning 32 µs per layer; bookkeeping free. Backward ends
    # at 7600; the gradient reduces (16 B each, 660 µs) 7600-8260-8920. The four factor
    # reduces (12 B, 620 µs) 8920-9540-10160-10780-11400, weights (40 B) -12800, the
    # finite flag (4 B) -13840. Each owner inverts its two factors 13840-14440; failure
    # flags (16 B) -15600; preconditions its layer -15632; KL sum (32 B) -16952; two
    # gather broadcasts (16 B) -17612-18272.
    result = simulate_strategy(two_layers, round_hardware, 2, "osawa")
    spans: dict[tuple[int, str], tuple[float, float]] = {
        (e.rank, e.name): (round(e.start * 1e6, 3), round(e.end * 1e6, 3))
        for e in result.events
        if e.duration > 0
    }
    owners = _setup(two_layers, round_hardware, 2, "osawa").layer_owners
    for layer, rank in owners.items():
        other = 1 - rank
        assert spans[rank, f"kfac/inverse_compute/{layer}/A"] == (13840.0, 14140.0)
        assert spans[rank, f"kfac/inverse_compute/{layer}/G"] == (14140.0, 14440.0)
        assert (other, f"kfac/inverse_compute/{layer}/A") not in spans
        assert spans[rank, f"kfac/precondition/{layer}"] == (15600.0, 15632.0)
        assert (other, f"kfac/precondition/{layer}") not in spans
    for rank in (0, 1):
        assert spans[rank, "kfac/grad_comm/wait"] == (7600.0, 8920.0)
        assert spans[rank, "kfac/factor_comm/wait"] == (8920.0, 12800.0)
        assert spans[rank, "kfac/factor_comm/finite"] == (12800.0, 13840.0)
        assert spans[rank, "kfac/inverse_comm/failures"] == (14440.0, 15600.0)
        assert spans[rank, "kfac/flag_comm/kl_clip"] == (15632.0, 16952.0)
        assert spans[rank, "kfac/grad_comm/all_gather"] == (16952.0, 18272.0)
        assert (rank, "kfac/inverse_comm/wait") not in spans
    assert result.iteration_s == pytest.approx(18272e-6, abs=1e-9)
    # GradComm: the reduces' wait 1320 and the gather 1320 µs; FactorComm 3880 + 1040.
    assert result.breakdown["GradComm"] == pytest.approx(2640e-6, abs=1e-9)
    assert result.breakdown["FactorComm"] == pytest.approx(4920e-6, abs=1e-9)
    assert result.breakdown["InverseComm"] == pytest.approx(1160e-6, abs=1e-9)


def _labelled(collectives: list[Collective], prefix: str) -> list[tuple[int, float]]:
    """(owner, bytes) of the reduces labelled ``<prefix> to <owner>``, in issue order."""
    return [
        (int(c.label.rpartition(" to ")[2]), c.nbytes)
        for c in collectives
        if c.label.startswith(f"{prefix} to ")
    ]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", OWNER_ROWS)
def test_each_bucket_is_one_reduce_per_owner(name: str, world_size: int) -> None:
    """Every reduce-scattered bucket is the same buffer D-KFAC or SGD all-reduces, split
    into one reduce per owner with a non-empty chunk, in rank order, each priced as a
    broadcast of its chunk."""
    workload = workload_for("resnet20", batch_size=8)
    hardware = cpu_preset()
    setup = _setup(workload, hardware, world_size, name)
    owned = _collectives(setup)
    # The same buckets, all-reduced, by the row that differs only in owner_computes.
    base = replace(STRATEGY_TABLE[name], final=REPLICATED)
    reference = _collectives(
        prepare(WorkloadCosts(workload, hardware, world_size), base, plan=setup.plan)
    )
    sgd = {c.label: c for c in _collectives(_setup(workload, hardware, world_size, "sgd"))}
    factor_ar = [c for c in reference if c.label.startswith("factor bucket")]
    chunks = scatter_chunks(setup)
    assert len(chunks["factors"]) == len(factor_ar) > 1
    for index, (whole, expected) in enumerate(zip(factor_ar, chunks["factors"], strict=True)):
        reduces = _labelled(owned, f"factor bucket {index}")
        assert reduces == list(expected.items())
        assert [owner for owner, _ in reduces] == sorted({owner for owner, _ in reduces})
        assert all(nbytes > 0 for _, nbytes in reduces)
        assert sum(nbytes for _, nbytes in reduces) == whole.nbytes
    for index in range(len(setup.grad_buckets)):
        label = f"grad bucket {index}"
        reduces = _labelled(owned, label)
        assert reduces == list(chunks["gradients"][index].items())
        unowned = [c.nbytes for c in owned if c.label == f"{label} (no owner)"]
        assert sum(nbytes for _, nbytes in reduces) + sum(unowned) == sgd[label].nbytes
    # Batch-norm parameters have no owner: their gradients are all-reduced.
    unowned_ops = {c.op for c in owned if c.label.endswith("(no owner)")}
    assert unowned_ops == {CollectiveOp.ALL_REDUCE}
    scattered = [c for c in owned if " to " in c.label]
    assert {c.op for c in scattered} == {CollectiveOp.REDUCE}
    assert {owner for c in chunks["factors"] for owner in c} == set(range(world_size))
    price = hardware.collective(CollectiveOp.BROADCAST, world_size)
    for c in scattered:
        line = price.choose(c.nbytes)[1]
        assert (c.alpha, c.work) == pytest.approx((line.alpha, line.beta * c.nbytes))
    # The gather sends every layer's g·a preconditioned elements exactly once.
    gathers = [c for c in owned if c.label.startswith("gather from")]
    layers = workload.layers
    assert sum(c.nbytes for c in gathers) == 4.0 * sum(la.g_dim * la.a_dim for la in layers)


def test_owners_with_an_empty_chunk_issue_nothing(round_hardware: Hardware) -> None:
    # Two equal layers on three ranks: one rank owns nothing and receives no reduce.
    setup = _setup(_equal_layers(2, dim=2), round_hardware, 3, "osawa")
    idle = ({0, 1, 2} - set(setup.layer_owners.values())).pop()
    collectives = _collectives(setup)
    assert [c.label for c in collectives if c.label.startswith("grad bucket")] == [
        f"grad bucket 0 to {owner}" for owner in sorted(setup.layer_owners.values())
    ]
    assert all(not c.label.endswith(f" to {idle}") for c in collectives)
    reduces = {c.label: c.nbytes for c in collectives if c.op is CollectiveOp.REDUCE}
    # Each owner's layer: 2·2 gradient floats (16 B), 3 packed floats per factor (12 B).
    assert {n for label, n in reduces.items() if label.startswith("grad")} == {16.0}
    factor = [n for label, n in reduces.items() if label.startswith("factor")]
    assert sum(factor) == 4 * 12.0 and len(factor) >= 2


def test_no_inverse_broadcasts() -> None:
    workload = workload_for("resnet20", batch_size=8)
    hardware = cpu_preset()
    for name in OWNER_ROWS:
        setup = _setup(workload, hardware, 4, name)
        assert setup.groups == ()
        broadcasts = [c.label for c in _collectives(setup) if c.op is CollectiveOp.BROADCAST]
        # DDP's buffers, then one gather per owner; no inverse ever travels.
        assert broadcasts == ["buffers", *(f"gather from {rank}" for rank in range(4))]
        result = simulate_strategy(workload, hardware, 4, name)
        names = {event.name for event in result.events}
        assert "kfac/inverse_comm/wait" not in names
        assert "kfac/inverse_compute/pack" not in names
        assert "kfac/grad_comm/all_gather" in names
        assert "no inverse broadcast" in result.plan


def test_plan_is_the_real_layer_owners_plan() -> None:
    workload = workload_for("resnet20", batch_size=8)
    hardware = cpu_preset()
    world_size = 4
    setup = _setup(workload, hardware, world_size, "osawa")
    specs = [
        FactorSpec(layer.name, kind, dim)
        for layer in workload.layers
        for kind, dim in (("A", layer.a_dim), ("G", layer.g_dim))
    ]
    cost_model = hardware.cost_model(world_size)
    expected = plan_layer_owners(specs, world_size, cost_model)
    assert setup.plan == expected
    assert setup.plan == plan_inversions(specs, world_size, "layer-owners", cost_model)
    assert len(set(expected.owners)) == world_size  # 20 layers spread over every rank
    # Every rank inverts and preconditions exactly the layers the plan gives it.
    events = simulate_strategy(workload, hardware, world_size, "osawa").events
    for spec, owner in zip(expected.factors, expected.owners, strict=True):
        ranks = {e.rank for e in events if e.name == f"kfac/inverse_compute/{spec.key}"}
        assert ranks == {owner}, spec.key
        ranks = {e.rank for e in events if e.name == f"kfac/precondition/{spec.layer}"}
        assert ranks == {owner}, spec.layer


def test_a_plan_that_splits_a_layer_is_refused(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    specs = [FactorSpec(n, k, 2) for n in ("fc1", "fc2") for k in ("A", "G")]
    costs = WorkloadCosts(two_layers, round_hardware, 2)
    for owners in ((0, 1, 0, 1), (0, 0, EVERY_RANK, EVERY_RANK)):
        plan = Plan("mine", 2, tuple(specs), owners, (0.0,) * 4)
        with pytest.raises(ValueError, match="every factor of a layer on one rank"):
            prepare(costs, STRATEGY_TABLE["osawa"], plan)


def _equal_layers(count: int, dim: int = 64) -> Workload:
    """``count`` identical linear layers in a chain."""
    names = [f"fc{i}" for i in range(count)]
    forward: list[Op | FactorHook | GradReady] = []
    backward: list[Op | FactorHook | GradReady] = []
    for name in names:
        forward += [FactorHook("A", name), Op("aten.mm", 1e6, 0.0)]
    for name in reversed(names):
        backward += [
            FactorHook("G", name),
            Op("aten.mm", 2e6, 0.0),
            GradReady(f"{name}.weight", dim * dim),
        ]
    return Workload(
        model="equal",
        batch_size=4,
        input_shape=(dim,),
        layers=tuple(LayerSpec(name, "linear", dim, dim, 4) for name in names),
        forward=tuple(forward),
        backward=tuple(backward),
        parameters=tuple((f"{name}.weight", dim * dim) for name in names),
    )


def test_memory_falls_as_one_over_p() -> None:
    workload = _equal_layers(8)
    hardware = cpu_preset()
    everything = 8 * 2 * 4 * (64 * 64 + 64 * 64)  # 8 layers, A and G, factor + inverse
    for world_size in (1, 2, 4, 8):
        for name in ("d-kfac", "spd-kfac"):
            setup = _setup(workload, hardware, world_size, name)
            assert factor_memory_bytes(setup) == everything
        for name in OWNER_ROWS:
            result = simulate_strategy(workload, hardware, world_size, name)
            assert result.factor_memory_bytes == everything // world_size, (name, world_size)
    assert simulate_strategy(workload, hardware, 4, "sgd").factor_memory_bytes == 0


def test_memory_is_the_most_loaded_owner(two_layers: Workload, round_hardware: Hardware) -> None:
    # fc1 and fc2 hold 2·2 floats per factor and per inverse: 4·4·4 = 64 B each.
    assert simulate_strategy(two_layers, round_hardware, 2, "d-kfac").factor_memory_bytes == 128
    assert simulate_strategy(two_layers, round_hardware, 2, "osawa").factor_memory_bytes == 64
    # With more ranks than layers the largest layer bounds it.
    workload = workload_for("resnet20", batch_size=8)
    setup = _setup(workload, cpu_preset(), 64, "osawa")
    largest = max(2 * 4 * (la.a_dim**2 + la.g_dim**2) for la in workload.layers)
    assert factor_memory_bytes(setup) == largest


def test_parameters_without_owner_are_all_reduced(round_hardware: Hardware) -> None:
    base = _equal_layers(2, dim=2)
    backward = (*base.backward, GradReady("norm.weight", 3))
    workload = replace(base, backward=backward, parameters=(*base.parameters, ("norm.weight", 3)))
    setup = _setup(workload, round_hardware, 2, "osawa")
    grads = [(c.label, c.op, c.nbytes) for c in _collectives(setup) if "grad" in c.label]
    assert grads == [
        ("grad bucket 0 to 0", CollectiveOp.REDUCE, 16.0),
        ("grad bucket 0 to 1", CollectiveOp.REDUCE, 16.0),
        ("grad bucket 0 (no owner)", CollectiveOp.ALL_REDUCE, 12.0),
    ]


def test_one_rank_is_d_kfac(two_layers: Workload, round_hardware: Hardware) -> None:
    osawa = simulate_strategy(two_layers, round_hardware, 1, "osawa")
    d_kfac = simulate_strategy(two_layers, round_hardware, 1, "d-kfac")
    assert osawa.iteration_s == pytest.approx(d_kfac.iteration_s, rel=1e-12)
    assert osawa.factor_memory_bytes == d_kfac.factor_memory_bytes


@pytest.mark.parametrize("world_size", [5, 12])
@pytest.mark.parametrize("name", OWNER_ROWS)
def test_one_rank_per_class_is_every_rank(
    hardware_factory: Callable[..., Hardware], name: str, world_size: int
) -> None:
    workload = _equal_layers(3, dim=4)
    hardware = replace(
        hardware_factory(world_size=world_size), overlap=0.4, contention=0.3, broadcast_overlap=0.6
    )
    setup = _setup(workload, hardware, world_size, name)
    programs, collectives = build_iteration(setup, factor_step=True, inverse_step=True)
    full = simulate(
        programs, collectives, overlap=hardware.overlap, contention=hardware.contention
    ).events
    result = simulate_strategy(workload, hardware, world_size, name)
    assert result.iteration_s == pytest.approx(max(e.end for e in full), rel=1e-12)
    expected = breakdown(full, 1)
    for category, seconds in result.breakdown.items():
        assert seconds == pytest.approx(expected[category], rel=1e-9, abs=1e-15), category
    # Three owners and the ranks that own nothing.
    assert len(rank_classes(setup, inverse_step=False)) == 4


def test_cli_reports_memory(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--model", "resnet20", "--workers", "4", "--preset", "cpu"]
    flags += ["--batch-size", "8", "--strategies", "d-kfac,osawa,osawa-pipelined"]
    assert main([*flags, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    memory = {name: value["runs"][0]["factor_memory_bytes"] for name, value in document.items()}
    assert 0 < memory["osawa"] == memory["osawa-pipelined"] < memory["d-kfac"]
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert "factors+inverses MiB/rank" in text
    row = next(line for line in text.splitlines() if line.startswith("| 4 | osawa |"))
    assert row.endswith(f"| {memory['osawa'] / 2**20:.1f} |")


def test_auto_is_the_fastest_of_its_candidates() -> None:
    from spdkfac.sim.strategies import parse_strategies
    from spdkfac.strategies import AUTO_CANDIDATES

    workload, hardware = workload_for("resnet32", batch_size=32), cpu_preset()
    tried = {name: simulate_strategy(workload, hardware, 4, name) for name in AUTO_CANDIDATES}
    auto = simulate_strategy(workload, hardware, 4, "auto")
    best = min(tried.values(), key=lambda result: result.iteration_s)
    assert auto.strategy == "auto" and auto.iteration_s == best.iteration_s
    assert auto.plan.startswith(f"chose {best.strategy} (")
    assert parse_strategies("d-kfac,auto") == ("d-kfac", "auto")

"""``layer-paths`` in the simulator: the path planner's owner layers take osawa's path,
the others SPD-KFAC's replicated path, on one timeline."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from spdkfac.cli.main import main
from spdkfac.costmodel import PolynomialInverseModel
from spdkfac.planning.paths import OWNER, REPLICATED, plan_gradient_paths
from spdkfac.planning.placement import (
    EVERY_RANK,
    Balanced,
    Plan,
    plan_balanced,
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
from spdkfac.sim.fsdp import fsdp_collectives
from spdkfac.sim.program import Collective, Compute, Instruction
from spdkfac.sim.strategies import (
    StrategySetup,
    factor_memory_bytes,
    layer_gradients,
    prepare,
)
from spdkfac.sim.timeline import build_iteration

AR, RD, BC = CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE, CollectiveOp.BROADCAST
#: (factor step, inverse step) of every kind of iteration.
KINDS = ((True, True), (True, False), (False, True), (False, False))


def _chain(dims: dict[str, int]) -> Workload:
    """Square linear layers in a chain (A and G of ``dim`` sides, ``dim²`` weights)."""
    forward: list[Op | FactorHook | GradReady] = []
    backward: list[Op | FactorHook | GradReady] = []
    for name in dims:
        forward += [FactorHook("A", name), Op("aten.mm", 1000.0, 0.0)]
    for name, dim in reversed(dims.items()):
        backward += [
            FactorHook("G", name),
            Op("aten.mm", 2000.0, 0.0),
            GradReady(f"{name}.weight", dim * dim),
        ]
    return Workload(
        model="chain",
        batch_size=4,
        input_shape=(next(iter(dims.values())),),
        layers=tuple(LayerSpec(name, "linear", dim, dim, 4) for name, dim in dims.items()),
        forward=tuple(forward),
        backward=tuple(backward),
        parameters=tuple((f"{name}.weight", dim * dim) for name, dim in dims.items()),
    )


#: small (2x2 factors, 4 weights) and big (8x8 factors, 64 weights).
CHAIN = _chain({"small": 2, "big": 8})


def _hardware(
    factory: Callable[..., Hardware],
    *,
    broadcast: tuple[float, float],
    allreduce: tuple[float, float],
    c0: float = 3e-4,
    c3: float = 0.0,
) -> Hardware:
    inverse = PolynomialInverseModel(c0=c0, c2=0.0, c3=c3)
    return replace(factory(broadcast=broadcast, allreduce=allreduce), inverse=inverse)


def _setup(
    workload: Workload, hardware: Hardware, world: int, name: str, plan: Plan | None = None
) -> StrategySetup:
    return prepare(WorkloadCosts(workload, hardware, world), STRATEGY_TABLE[name], plan)


def _iteration(
    setup: StrategySetup, factor_step: bool = True, inverse_step: bool = True
) -> tuple[list[list[Instruction]], list[Collective]]:
    return build_iteration(setup, factor_step=factor_step, inverse_step=inverse_step)


#: A collective as the engine runs it: label, op, bytes, channel, start-up, transfer.
Priced = tuple[str, CollectiveOp | None, float, str, float, float]


def _priced(collectives: list[Collective]) -> list[Priced]:
    return [(c.label, c.op, c.nbytes, c.channel, c.alpha, c.work) for c in collectives]


def test_the_row_is_simulated() -> None:
    row = STRATEGY_TABLE["layer-paths"]
    assert row.final.chooses_paths and row.owner_computes
    assert row.factor_exchange == "after-backward" and row.placement == "balanced"


# ----------------------------------------------------------------- every layer to its owner
def test_every_layer_to_its_owner_is_osawa(hardware_factory: Callable[..., Hardware]) -> None:
    # Cheap all-reduce start-ups, dear broadcasts: the path planner sends both layers to
    # their owners, placed as osawa's planner places them (big on 0, small on 1).
    hardware = _hardware(hardware_factory, broadcast=(5e-4, 1e-5), allreduce=(1e-4, 1e-6))
    cost_model = hardware.cost_model(2)
    paths = plan_gradient_paths(layer_gradients(CHAIN), 2, cost_model, Balanced())
    assert dict(paths.paths) == {"small": OWNER, "big": OWNER}
    paths_setup = _setup(CHAIN, hardware, 2, "layer-paths")
    osawa = _setup(CHAIN, hardware, 2, "osawa")
    assert paths_setup.plan == paths.placement
    assert dict(paths_setup.layer_owners) == dict(osawa.layer_owners) == {"small": 1, "big": 0}
    assert paths_setup.plan is not None and osawa.plan is not None
    assert paths_setup.plan.owners == osawa.plan.owners
    for factor_step, inverse_step in KINDS:
        mine = _iteration(paths_setup, factor_step, inverse_step)
        theirs = _iteration(osawa, factor_step, inverse_step)
        assert mine[0] == theirs[0]
        assert _priced(mine[1]) == _priced(theirs[1])
    result = simulate_strategy(CHAIN, hardware, 2, "layer-paths", inv_update_steps=3)
    reference = simulate_strategy(CHAIN, hardware, 2, "osawa", inv_update_steps=3)
    assert result.iteration_s == reference.iteration_s
    assert result.breakdown == reference.breakdown
    assert result.factor_memory_bytes == reference.factor_memory_bytes
    assert "no inverse broadcast" in result.plan


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_all_owner_plan_is_osawa_on_resnet20(world_size: int) -> None:
    workload = workload_for("resnet20", batch_size=8)
    hardware = cpu_preset()
    specs = workload.factors
    plan = plan_layer_owners(specs, world_size, hardware.cost_model(world_size))
    assert plan.owner_layers == {spec.layer for spec in specs}
    paths_setup = _setup(workload, hardware, world_size, "layer-paths", plan=plan)
    osawa = _setup(workload, hardware, world_size, "osawa", plan=plan)
    assert paths_setup.groups == osawa.groups == ()
    for factor_step, inverse_step in KINDS:
        mine = _iteration(paths_setup, factor_step, inverse_step)
        theirs = _iteration(osawa, factor_step, inverse_step)
        assert mine[0] == theirs[0]
        assert _priced(mine[1]) == _priced(theirs[1])
    result = simulate_strategy(workload, hardware, world_size, "layer-paths", plan=plan)
    reference = simulate_strategy(workload, hardware, world_size, "osawa", plan=plan)
    assert result.iteration_s == reference.iteration_s
    assert result.factor_memory_bytes == reference.factor_memory_bytes


# ------------------------------------------------------------------- every layer replicated
def test_every_layer_replicated_is_spd_kfacs_placement_plus_the_owner_stages_flags(
    hardware_factory: Callable[..., Hardware],
) -> None:
    # Dear all-reduce start-ups, inversions (300 µs) dearer than a broadcast (100 µs +
    # 1 µs/B): both layers take the replicated path and each factor is communicated.
    hardware = _hardware(hardware_factory, broadcast=(1e-4, 1e-6), allreduce=(1e-3, 1e-5))
    paths = plan_gradient_paths(layer_gradients(CHAIN), 2, hardware.cost_model(2), Balanced())
    assert dict(paths.paths) == {"small": REPLICATED, "big": REPLICATED}
    setup = _setup(CHAIN, hardware, 2, "layer-paths")
    assert setup.owner_computes and not setup.layer_owners
    # The reference: SPD-KFAC's balanced CT/NCT placement and fused broadcasts with the
    # row's after-backward exchange (the placement-only ablation), on the same plan.
    reference = _setup(CHAIN, hardware, 2, "placement-only")
    assert reference.plan == plan_balanced(CHAIN.factors, 2, hardware.cost_model(2))
    assert setup.plan is not None and reference.plan is not None
    assert setup.plan.owners == reference.plan.owners == (0, 1, 0, 1)
    assert setup.groups == reference.groups and len(setup.groups) == 2
    layers = len(CHAIN.layers)
    for factor_step, inverse_step in KINDS:
        mine = _priced(_iteration(setup, factor_step, inverse_step)[1])
        # The same buckets (all-reduced whole: nothing is owned), broadcasts and flags.
        theirs = [
            (c[0].removesuffix(" (no owner)"), *c[1:])
            for c in mine
            if c[0] not in ("factor finite flag", "kl clip sum")
        ]
        expected = _priced(_iteration(reference, factor_step, inverse_step)[1])
        if not factor_step:  # the owner stage agrees on the skip in the KL all-reduce
            expected = [c for c in expected if c[0] != "skip flag"]
        assert theirs == expected
        # What the owner stage adds, as the real OwnerStage and exchange issue it: the
        # factors' finite flag (4 B) and the KL clip's sum, skip flag and presence flags
        # (float64, 2 + layers); no gather, as nobody owns a layer.
        owner_stage = ("factor finite flag", "kl clip sum")
        added = [c[:3] for c in mine if c[0] in owner_stage]
        flags = [("factor finite flag", AR, 4.0)] if factor_step else []
        assert added == [*flags, ("kl clip sum", AR, 8.0 * (2 + layers))]
        assert not any(c[0].startswith("gather") for c in mine)
    # With free bookkeeping the ranks meet at the failure flags, so the iteration is the
    # reference's plus the two flags' all-reduces: (1000 + 10·4) + (1000 + 10·32) µs.
    result = simulate_strategy(CHAIN, hardware, 2, "layer-paths")
    assert "no layer on an owner" in result.plan and "2/4 factors communicated" not in result.plan
    ours = simulate_strategy(CHAIN, hardware, 2, "placement-only")
    assert result.iteration_s == pytest.approx(ours.iteration_s + 1040e-6 + 1320e-6, abs=1e-9)
    assert result.factor_memory_bytes == ours.factor_memory_bytes


def test_one_rank_is_the_replicated_path(two_layers: Workload, round_hardware: Hardware) -> None:
    setup = _setup(two_layers, round_hardware, 1, "layer-paths")
    assert not setup.owner_computes and not setup.layer_owners
    assert setup.plan is not None and set(setup.plan.owners) == {EVERY_RANK}
    result = simulate_strategy(two_layers, round_hardware, 1, "layer-paths")
    d_kfac = simulate_strategy(two_layers, round_hardware, 1, "d-kfac")
    assert result.iteration_s == pytest.approx(d_kfac.iteration_s, rel=1e-12)


# --------------------------------------------------------------------------- mixed paths
def _mixed(factory: Callable[..., Hardware]) -> Hardware:
    """Inversions ``1e-4 + 1e-5·d³`` s; broadcasts 100 µs + 1 µs/B; all-reduces 1000 µs +
    10 µs/B: big (8x8) goes to its owner, small (2x2) the replicated way, both of its
    factors communicated (an inversion, 180 µs, dearer than a broadcast, 112 µs)."""
    return _hardware(factory, broadcast=(1e-4, 1e-6), allreduce=(1e-3, 1e-5), c0=1e-4, c3=1e-5)


def test_mixed_paths_collectives_by_hand(hardware_factory: Callable[..., Hardware]) -> None:
    hardware = _mixed(hardware_factory)
    setup = _setup(CHAIN, hardware, 2, "layer-paths")
    plan = setup.plan
    assert plan is not None
    assert (
        plan
        == plan_gradient_paths(
            layer_gradients(CHAIN), 2, hardware.cost_model(2), Balanced()
        ).placement
    )
    assert plan.owner_layers == {"big"} and dict(setup.layer_owners) == {"big": 0}
    assert plan.owner_by_key == {"small/A": 0, "small/G": 1, "big/A": 0, "big/G": 0}
    # One DDP bucket [big.weight (64 floats), small.weight (4)]; after-backward factor
    # buckets [small/A, big/A] and [big/G, small/G]; packed triangles: small 3, big 36.
    assert setup.grad_buckets == (("big.weight", "small.weight"),)
    assert setup.fusion is not None
    assert setup.fusion.buckets == (("small/A", "big/A"), ("big/G", "small/G"))
    collectives = _iteration(setup)[1]
    assert [(c.label, c.op, c.nbytes) for c in collectives] == [
        # Owner path: big's 64 gradient floats reduced to its owner (256 B); replicated
        # path: small's 4 all-reduced (16 B), after, as reduce_to_owners issues them.
        ("grad bucket 0 to 0", RD, 256.0),
        ("grad bucket 0 (no owner)", AR, 16.0),
        # Each factor bucket laid out owners first: big's 36 packed floats (144 B)
        # reduced to rank 0, then small's 3 (12 B, EVERY_RANK) all-reduced.
        ("factor bucket 0 to 0", RD, 144.0),
        ("factor bucket 0 (no owner)", AR, 12.0),
        ("factor bucket 1 to 0", RD, 144.0),
        ("factor bucket 1 (no owner)", AR, 12.0),
        ("factor weights", AR, 8.0 * (2 * 2 + 1)),
        ("factor finite flag", AR, 4.0),
        # small's communicated inverses, one packed triangle each (12 B) from its
        # placed owner; big's inverses stay on rank 0.
        ("broadcast 0 from 0", BC, 12.0),
        ("broadcast 1 from 1", BC, 12.0),
        ("failure flags", AR, 4.0 * 2 * 2),
        ("kl clip sum", AR, 8.0 * (2 + 2)),
        # big's 8·8 preconditioned floats from its owner.
        ("gather from 0", BC, 256.0),
    ]
    factor = {c.label: c.channel for c in collectives if c.label.startswith("factor bucket")}
    assert set(factor.values()) == {"default"}  # after-backward: the exchange's one group


def _computed(program: list[Instruction], phase: str) -> list[str]:
    return [
        step.name.removeprefix(f"kfac/{phase}/")
        for step in program
        if isinstance(step, Compute) and step.name and step.name.startswith(f"kfac/{phase}/")
    ]


def test_mixed_paths_work_per_rank(hardware_factory: Callable[..., Hardware]) -> None:
    hardware = _mixed(hardware_factory)
    setup = _setup(CHAIN, hardware, 2, "layer-paths")
    programs, _ = _iteration(setup)
    # Rank 0 inverts small/A for its broadcast (and packs it), then its own layer's
    # factors; rank 1 small/G. Both precondition small, only the owner big.
    assert _computed(programs[0], "inverse_compute") == ["small/A", "pack", "big/A", "big/G"]
    assert _computed(programs[1], "inverse_compute") == ["small/G", "pack"]
    assert _computed(programs[0], "precondition") == ["small", "big", "kl_clip", "write"]
    assert _computed(programs[1], "precondition") == ["small", "kl_clip", "write"]
    assert setup.held_layers(0) == ("small", "big") and setup.held_layers(1) == ("small",)
    # Rank 0 holds both layers' factors and inverses: 4·(4 + 4)·2 + 4·(64 + 64)·2 bytes.
    assert factor_memory_bytes(setup) == 64 + 1024
    result = simulate_strategy(CHAIN, hardware, 2, "layer-paths")
    assert result.plan.startswith("layer-paths: 1 layers on 1 owner(s)")
    assert "1 replicated layer(s): 2/2 factors communicated in 2 broadcast(s)" in result.plan
    names = {(e.rank, e.name) for e in result.events}
    assert (1, "kfac/inverse_comm/wait") in names and (0, "kfac/grad_comm/all_gather") in names
    assert (1, "kfac/precondition/big") not in names


@pytest.mark.parametrize("world_size", [3, 5])
def test_one_rank_per_class_is_every_rank(
    hardware_factory: Callable[..., Hardware], world_size: int
) -> None:
    workload = _chain({"a": 2, "b": 8, "c": 8, "d": 3})
    hardware = _hardware(
        lambda **kw: hardware_factory(world_size=world_size, **kw),
        broadcast=(1e-4, 1e-6),
        allreduce=(1e-3, 1e-5),
        c0=1e-4,
        c3=1e-5,
    )
    hardware = replace(hardware, overlap=0.4, contention=0.3, broadcast_overlap=0.6)
    setup = _setup(workload, hardware, world_size, "layer-paths")
    assert setup.layer_owners and setup.groups  # both paths
    assert set(setup.layer_owners) < {layer.name for layer in workload.layers}
    programs, collectives = _iteration(setup)
    full = simulate(programs, collectives, overlap=0.4, contention=0.3).events
    result = simulate_strategy(workload, hardware, world_size, "layer-paths")
    assert result.iteration_s == pytest.approx(max(e.end for e in full), rel=1e-12)
    expected = breakdown(full, 1)
    for category, seconds in result.breakdown.items():
        assert seconds == pytest.approx(expected[category], rel=1e-9, abs=1e-15), category
    # Ranks differ by the owner-path layers and the broadcasts they own.
    owners = {*setup.layer_owners.values(), *(group.owner for group in setup.groups)}
    assert len(rank_classes(setup, inverse_step=True)) == len(owners) + (world_size > len(owners))


def test_fsdp_gathers_follow_the_paths(hardware_factory: Callable[..., Hardware]) -> None:
    step = [
        c
        for c in fsdp_collectives(CHAIN, _mixed(hardware_factory), 2, kfac="layer-paths")
        if c.step
    ]
    # small (replicated path) all-gathers its weight's 4 floats; big's 64 go to its owner
    # in one reduce-scatter of P·256 B.
    assert [(c.label, c.op, c.nbytes) for c in step] == [
        ("grad all-gather small.weight", CollectiveOp.ALL_GATHER, 16.0),
        ("owner scatter big", CollectiveOp.REDUCE_SCATTER, 512.0),
    ]


# ---------------------------------------------------------------------------------- CLI
def test_cli_prints_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--model", "resnet20", "--workers", "4", "--preset", "cpu"]
    flags += ["--batch-size", "8", "--strategies", "layer-paths"]
    assert main(flags) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| 4 | layer-paths |")]
    assert len(rows) == 1
    assert main([*flags, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    (run,) = document["layer-paths"]["runs"]
    assert run["iteration_s"] > 0 and run["plan"].startswith("layer-paths: ")

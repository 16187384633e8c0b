"""``comm_scheduler``: the backward window ordered by the runtime's own planner."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from merge_cases import PolicySpy
from spdkfac.cli.main import main
from spdkfac.planning.fusion import FUSION_POLICIES, plan_dp
from spdkfac.planning.schedule import (
    COMM_SCHEDULERS,
    FACTORS,
    GRADIENTS,
    CommSchedule,
    ScheduledCall,
    chunk_elements_for,
)
from spdkfac.profiling import Event
from spdkfac.sim import (
    WINDOW_POLICIES,
    FactorHook,
    GradReady,
    Hardware,
    LayerSpec,
    Op,
    Workload,
    parse_comm_schedulers,
    simulate,
    simulate_strategy,
)
from spdkfac.sim.builder import IterationBuilder, ScheduledWindow
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.program import Instruction, Issue
from spdkfac.sim.strategies import STRATEGY_TABLE, StrategySetup, prepare
from spdkfac.sim.timeline import build_iteration
from spdkfac.sim.window import PriorityWindow, chunk_line, nominal_ready_times, window_calls

#: α 10 µs, β 10 ns/byte: chunks of chunk_elements_for's floor, 16,384 elements (655 µs).
LINK = (1e-5, 1e-8)


@pytest.fixture
def big_factor() -> Workload:
    """One layer whose A factor (1000 x 1000: 500,500 packed elements, 20 ms on ``LINK``)
    is ready 100 µs into the forward pass; its 100,000-element gradient (4 ms) is ready
    at 4,300 µs, while A is still in flight (``round_hardware``'s times)."""
    return Workload(
        model="big-factor",
        batch_size=4,
        input_shape=(999,),
        layers=(LayerSpec("fc", "linear", a_dim=1000, g_dim=10, rows=4),),
        forward=(FactorHook("A", "fc"), Op("aten.mm", 1000, 0.0), Op("aten.mm", 500, 0.0)),
        backward=(
            Op("aten.mm", 500, 0.0),
            FactorHook("G", "fc"),
            Op("aten.mm", 2000, 0.0),
            GradReady("fc.weight", 100_000),
        ),
        parameters=(("fc.weight", 100_000),),
    )


def _setup(workload: Workload, hardware: Hardware, scheduler: str) -> StrategySetup:
    costs = WorkloadCosts(workload, hardware, 2)
    return prepare(costs, STRATEGY_TABLE["spd-kfac"], comm_scheduler=scheduler)


def _grad_wait_end(events: tuple[Event, ...]) -> float:
    return max(e.end for e in events if e.name == "kfac/grad_comm/wait")


def test_the_option_names_every_policy() -> None:
    assert tuple(WINDOW_POLICIES) == COMM_SCHEDULERS
    assert parse_comm_schedulers("both") == COMM_SCHEDULERS
    assert parse_comm_schedulers(" priority , fifo,priority") == ("priority", "fifo")


@pytest.mark.parametrize("text", ["lifo", "", "fifo,round-robin"])
def test_bad_scheduler_names_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="comm_scheduler"):
        parse_comm_schedulers(text)


def test_simulate_strategy_refuses_an_unknown_scheduler(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    with pytest.raises(ValueError, match=r"comm_scheduler.*'lifo'"):
        simulate_strategy(two_layers, round_hardware, 2, "spd-kfac", comm_scheduler="lifo")


@pytest.mark.parametrize("strategy", ["sgd", "d-kfac", "mpd-kfac", "osawa-pipelined"])
def test_priority_without_a_window_is_fifo(
    strategy: str, two_layers: Workload, round_hardware: Hardware
) -> None:
    """No factor bucket in flight during backward (or owners reduce-scatter): no plan."""
    fifo = simulate_strategy(two_layers, round_hardware, 2, strategy)
    priority = simulate_strategy(two_layers, round_hardware, 2, strategy, comm_scheduler="priority")
    assert priority == replace(fifo, comm_scheduler="priority")


def test_steps_without_factors_are_unchanged(
    big_factor: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    hardware = hardware_factory(allreduce=LINK)
    kinds = {
        scheduler: {
            (k.factor_step, k.inverse_step): k
            for k in simulate_strategy(
                big_factor, hardware, 2, "spd-kfac", factor_update_steps=2,
                inv_update_steps=2, comm_scheduler=scheduler,
            ).kinds
        }
        for scheduler in COMM_SCHEDULERS
    }  # fmt: skip
    assert kinds["priority"][False, False] == kinds["fifo"][False, False]
    assert kinds["priority"][True, True] != kinds["fifo"][True, True]


def test_fifo_is_the_default_and_plans_nothing(
    big_factor: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    hardware = hardware_factory(allreduce=LINK)
    default = prepare(WorkloadCosts(big_factor, hardware, 2), STRATEGY_TABLE["spd-kfac"])
    fifo = _setup(big_factor, hardware, "fifo")
    assert fifo == default and fifo.window is None
    assert build_iteration(fifo, factor_step=True, inverse_step=True) == build_iteration(
        default, factor_step=True, inverse_step=True
    )


def test_gradients_preempt_a_large_factor_bucket(
    big_factor: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    """fifo: the gradient bucket shares the link with A for its whole 4 ms (8 ms); priority:
    it waits for at most one A chunk (655 µs), then has the link to itself."""
    hardware = hardware_factory(allreduce=LINK)
    fifo, priority = (
        simulate_strategy(big_factor, hardware, 2, "spd-kfac", comm_scheduler=scheduler)
        for scheduler in COMM_SCHEDULERS
    )
    ready = 4.3e-3
    grad_work = LINK[1] * 4 * 100_000
    assert _grad_wait_end(fifo.events) >= ready + 2 * grad_work
    chunk = LINK[0] + LINK[1] * 4 * 16_384
    assert _grad_wait_end(priority.events) <= ready + chunk + 7 * LINK[0] + grad_work + 1e-9
    assert "priority schedule" in priority.plan and "priority" not in fifo.plan


def test_the_engine_runs_the_plan_exactly(
    big_factor: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    """Free overlap, no contention, no issue cost, the planner's α-β = the link's: every
    chunk starts in the planned order and the window ends when the plan predicts (but
    for the weights all-reduce that shares the link at the end)."""
    hardware = hardware_factory(allreduce=LINK)
    setup = _setup(big_factor, hardware, "priority")
    schedule = setup.window
    assert schedule is not None and setup.fusion is not None
    assert schedule.sizes(FACTORS) == (500_500, 55) and schedule.sizes(GRADIENTS) == (100_000,)
    model = hardware.cost_model(2).allreduce
    assert schedule.chunk_elements == chunk_elements_for(chunk_line(model, 4 * 500_500), 4)
    programs, collectives = build_iteration(setup, factor_step=True, inverse_step=True)
    result = simulate(programs, collectives)
    labels = [f"{stream} bucket {index} chunk {chunk}" for stream, index, chunk in schedule.order]
    by_label = {c.label: i for i, c in enumerate(collectives)}
    starts = [result.starts[by_label[label]] for label in labels]
    assert starts == sorted(starts)
    end = max(result.ends[by_label[label]] for label in labels)
    # The exchange's weights all-reduce (on the factor channel, as at run time) shares
    # the link with the last chunks: they end later by at most its own transfer time.
    weights = collectives[by_label["factor weights"]]
    assert weights.channel == "factor"
    assert schedule.predicted_end - 1e-12 <= end <= schedule.predicted_end + weights.work + 1e-12
    _, fifo_collectives = build_iteration(
        _setup(big_factor, hardware, "fifo"), factor_step=True, inverse_step=True
    )
    moved = sum(c.nbytes for c in collectives if "chunk" in c.label)
    buckets = sum(c.nbytes for c in fifo_collectives if c.label.startswith(("grad", "factor b")))
    assert moved == buckets == 4 * (500_500 + 55 + 100_000)


def test_ready_times_follow_the_compute_only_timeline(
    big_factor: Workload, round_hardware: Hardware
) -> None:
    setup = _setup(big_factor, round_hardware, "fifo")
    assert setup.fusion is not None
    calls = window_calls(setup.costs, setup.grad_buckets, setup.fusion)
    ready = {(c.stream, c.index): round(c.ready * 1e6, 6) for c in calls}
    # A hook 0-100 µs; forward 100-1600; backward 1600-2100, G hook -2300, -4300.
    assert ready == {(FACTORS, 0): 100.0, (FACTORS, 1): 2300.0, (GRADIENTS, 0): 4300.0}


def test_a_gradient_chunk_waits_for_the_factor_bucket_planned_before_it(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    """Every rank issues the order as the data comes: a gradient bucket planned after a
    factor bucket waits for it, and the end of the backward pass launches every factor
    bucket still incomplete (with what it has), so the gradients never wait past it."""
    setup = prepare(WorkloadCosts(two_layers, round_hardware, 2), STRATEGY_TABLE["spd-kfac"])
    assert setup.fusion is not None
    count = len(setup.fusion.buckets)
    assert count > 1 and len(setup.grad_buckets) == 1
    calls = (
        ScheduledCall(GRADIENTS, 0, 8, 0.0),
        *(ScheduledCall(FACTORS, i, 3, 0.0) for i in range(count)),
    )
    order = ((FACTORS, 0, 0), (GRADIENTS, 0, 0), *((FACTORS, i, 0) for i in range(1, count)))
    builder = IterationBuilder(setup, range(2))
    window = ScheduledWindow(
        builder,
        CommSchedule("priority", calls, 16, order, 0.0),
        {GRADIENTS: setup.grad_buckets, FACTORS: setup.fusion.buckets},
    )
    out: list[Instruction] = []

    def issued() -> list[str]:
        return [builder.collectives[s.collective].label for s in out if isinstance(s, Issue)]

    for parameter in setup.grad_buckets[0]:
        window.stream(GRADIENTS).ready(parameter, out)
    assert issued() == []  # complete, but factor bucket 0 is not
    window.stream(GRADIENTS).flush(out, force=True)  # the backward pass ends
    assert issued() == [f"{stream} bucket {index} chunk 0" for stream, index, _ in order]
    assert {builder.collectives[i].channel for i in window.stream(FACTORS).all_ids} == {"scheduler"}


def test_jittered_ranks_still_issue_one_order(
    big_factor: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    """Ranks reach their hooks at different times; the order is the same on every rank, so
    the engine never deadlocks and every chunk completes."""
    hardware = replace(hardware_factory(allreduce=LINK, world_size=4), jitter=0.3)
    result = simulate_strategy(big_factor, hardware, 4, "spd-kfac", comm_scheduler="priority")
    assert result.iteration_s > 0 and result.kinds[0].simulated_ranks == 4


def test_cli_labels_the_priority_results(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate", "--model", "mlp", "--workers", "2", "--preset", "cpu", "--json",
            "--strategies", "spd-kfac", "--comm-scheduler", "both",
        ]
    )  # fmt: skip
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert list(document) == ["spd-kfac", "spd-kfac+priority"]
    assert [document[k]["runs"][0]["comm_scheduler"] for k in document] == ["fifo", "priority"]


def test_a_dp_fusion_plans_around_the_simulated_gradient_chunks(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    """Under ``"priority"`` a policy with ``around_gradients`` (``dp``) is given the link
    intervals of the window's gradient chunks, on the clock of the factors' hand-overs
    (from the step's first); under ``"fifo"`` nothing."""
    spy = PolicySpy(FUSION_POLICIES["dp"])
    costs = WorkloadCosts(two_layers, round_hardware, 2)
    strategy = replace(STRATEGY_TABLE["spd-kfac"], fusion=spy)
    prepare(costs, strategy, comm_scheduler="fifo")
    assert spy.seen[-1].busy == () and spy.seen[-1].chunk_elements is None
    setup = prepare(costs, strategy, comm_scheduler="priority")
    inputs = spy.seen[-1]
    busy, chunk = PriorityWindow().gradient_busy(costs, strategy, setup.grad_buckets)
    assert busy and inputs.chunk_elements == chunk
    assert inputs.a_ready is not None and inputs.g_ready is not None
    origin = nominal_ready_times(costs)["fc1/A"]  # the first hand-over
    assert min(inputs.a_ready) == 0.0
    assert [pytest.approx(i) for i in inputs.busy] == [(s - origin, e - origin) for s, e in busy]
    assert setup.fusion == plan_dp(
        inputs.a_order,
        inputs.g_order,
        inputs.sizes,
        inputs.a_ready,
        inputs.g_ready,
        inputs.allreduce,
        busy=inputs.busy,
        chunk_elements=chunk,
    )

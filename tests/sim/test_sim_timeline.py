"""Hand-checked timelines of the two-layer workload on two ranks, to the microsecond."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spdkfac.planning.placement import FactorSpec, Plan
from spdkfac.profiling import Event, Phase
from spdkfac.sim import Hardware, Workload, simulate_strategy

# Hardware (conftest ``round_hardware``): 1 FLOP = 1 µs; A 100 µs, G 200 µs, inverse
# 300 µs; all-reduce α 1000 µs + 10 µs/byte; broadcast α 500 µs + 10 µs/byte; every
# bookkeeping cost 0. Sizes: a factor 12 B, a gradient 16 B, the exchange's weights
# 8·(2·2+1) = 40 B, the failure flags 4·2·2 = 16 B.
#
# Forward/backward, the same on both ranks and for every strategy (times in µs):
#   A fc1 0-100 | fc1 100-1100 | A fc2 1100-1200 | fc2 + loss 1200-2700
#   loss bwd 2700-3200 | G fc2 3200-3400 | fc2 bwd 3400-5400 | G fc1 5400-5600
#   fc1 bwd 5600-7600: the last gradient is final; DDP's one bucket (32 B) starts:
#   7600 + 1000 + 320 = 8920, so grad_comm/wait 7600-8920.
COMMON = {
    "kfac/factor_compute/fc1/A": (0, 100),
    "kfac/factor_compute/fc2/A": (1100, 1200),
    "kfac/factor_compute/fc2/G": (3200, 3400),
    "kfac/factor_compute/fc1/G": (5400, 5600),
    "kfac/grad_comm/wait": (7600, 8920),
    "kfac/forward_backward/all": (0, 8920),
}


def _spans(events: list[Event] | tuple[Event, ...], rank: int) -> dict[str, list[tuple[int, int]]]:
    spans: dict[str, list[tuple[int, int]]] = {}
    for event in events:
        if event.rank == rank:
            spans.setdefault(event.name, []).append(
                (round(event.start * 1e6, 3), round(event.end * 1e6, 3))
            )
    return spans


def _check(spans: dict[str, list[tuple[int, int]]], expected: dict[str, object]) -> None:
    for name, value in expected.items():
        wanted = value if isinstance(value, list) else [value]
        assert spans.get(name) == [tuple(map(float, pair)) for pair in wanted], name


def test_d_kfac(two_layers: Workload, round_hardware: Hardware) -> None:
    result = simulate_strategy(two_layers, round_hardware, 2, "d-kfac")
    # step at 8920. after-backward: buckets [fc1/A, fc2/A] and [fc2/G, fc1/G] (24 B, 1240
    # µs each) and the weights (1400 µs), serialised on the default channel:
    # 8920-10160, 10160-11400, 11400-12800 -> factor_comm/wait 8920-12800.
    # Replicated inverses: fc1/A 12800-13100, fc1/G -13400, fc2/A -13700, fc2/G -14000.
    # Failure flags 14000 + 1000 + 160 = 15160. Precondition 2·2·2·(2+2) = 32 µs per
    # layer: 15160-15192, 15192-15224. The iteration ends at 15224.
    expected = {
        **COMMON,
        "kfac/factor_comm/wait": (8920, 12800),
        "kfac/inverse_compute/fc1/A": (12800, 13100),
        "kfac/inverse_compute/fc1/G": (13100, 13400),
        "kfac/inverse_compute/fc2/A": (13400, 13700),
        "kfac/inverse_compute/fc2/G": (13700, 14000),
        "kfac/inverse_comm/failures": (14000, 15160),
        "kfac/precondition/fc1": (15160, 15192),
        "kfac/precondition/fc2": (15192, 15224),
        "kfac/step/all": (8920, 15224),
        "kfac/iteration/all": (0, 15224),
    }
    for rank in (0, 1):
        _check(_spans(result.events, rank), expected)
    assert result.iteration_s == pytest.approx(15224e-6, abs=1e-9)
    # FF&BP = 8920 - 600 (factors) - 1320 (grad wait) = 7000 = the ops' sum.
    assert result.breakdown["FF&BP"] == pytest.approx(7000e-6, abs=1e-9)
    assert result.breakdown["GradComm"] == pytest.approx(1320e-6, abs=1e-9)
    assert result.breakdown["FactorComp"] == pytest.approx(600e-6, abs=1e-9)
    assert result.breakdown["FactorComm"] == pytest.approx(3880e-6, abs=1e-9)
    assert result.breakdown["InverseComp"] == pytest.approx(1200e-6, abs=1e-9)
    assert result.breakdown["InverseComm"] == pytest.approx(1160e-6, abs=1e-9)
    assert result.breakdown["Precondition"] == pytest.approx(64e-6, abs=1e-9)
    assert result.breakdown["Other"] == pytest.approx(0.0, abs=1e-9)


def test_mpd_kfac_broadcasts(two_layers: Workload, round_hardware: Hardware) -> None:
    result = simulate_strategy(two_layers, round_hardware, 2, "mpd-kfac")
    # Factor phase as in D-KFAC: the inverse phase starts at 12800. Round-robin owners:
    # fc1/A 0, fc1/G 1, fc2/A 0, fc2/G 1; broadcasts in order B0 fc1/A, B1 fc1/G, B2 fc2/A,
    # B3 fc2/G, 12 B each: 500 + 120 = 620 µs.
    # rank 0 inverts fc1/A 12800-13100, issues B0 and B1 at 13100, inverts fc2/A
    # 13100-13400; rank 1 issues B0 at 12800, inverts fc1/G 12800-13100, fc2/G 13100-13400.
    # B0 starts when rank 0 issues it (13100) and ends 13720; B1 13720-14340 (FIFO);
    # B2 14340-14960; B3 14960-15580. Both ranks wait 13400-15580 (one span per
    # broadcast), then the failure flags 15580-16740, precondition to 16804.
    waits = [(13400, 13720), (13720, 14340), (14340, 14960), (14960, 15580)]
    rank0 = {
        "kfac/inverse_compute/fc1/A": (12800, 13100),
        "kfac/inverse_compute/fc2/A": (13100, 13400),
        "kfac/inverse_comm/wait": waits,
        "kfac/inverse_comm/failures": (15580, 16740),
        "kfac/iteration/all": (0, 16804),
    }
    rank1 = {
        "kfac/inverse_compute/fc1/G": (12800, 13100),
        "kfac/inverse_compute/fc2/G": (13100, 13400),
        "kfac/inverse_comm/wait": waits,
        "kfac/inverse_comm/failures": (15580, 16740),
        "kfac/iteration/all": (0, 16804),
    }
    spans0, spans1 = _spans(result.events, 0), _spans(result.events, 1)
    _check(spans0, {**COMMON, "kfac/factor_comm/wait": (8920, 12800), **rank0})
    _check(spans1, {**COMMON, "kfac/factor_comm/wait": (8920, 12800), **rank1})
    assert "kfac/inverse_compute/fc1/G" not in spans0
    assert result.iteration_s == pytest.approx(16804e-6, abs=1e-9)
    assert result.breakdown["InverseComp"] == pytest.approx(600e-6, abs=1e-9)
    assert result.breakdown["InverseComm"] == pytest.approx((2180 + 1160) * 1e-6, abs=1e-9)


def test_layerwise_pipelining(two_layers: Workload, round_hardware: Hardware) -> None:
    result = simulate_strategy(two_layers, round_hardware, 2, "fusion:layerwise")
    # Every factor is its own bucket (1000 + 120 µs) on the factor channel, issued when its
    # hook ends: fc1/A 100-1220, fc2/A issued 1200 but FIFO behind it: 1220-2340, fc2/G
    # 3400-4520, fc1/G 5600-6720; none overlaps the gradient bucket (7600-8920). At the
    # step only the weights remain (8920-10320). The balanced placement keeps every
    # factor local (inverse 300 µs <= broadcast 500 + 120 µs): inverses 10320-11520,
    # failure flags 11520-12680, precondition to 12744.
    expected = {
        **COMMON,
        "kfac/factor_comm/wait": (8920, 10320),
        "kfac/inverse_compute/fc1/A": (10320, 10620),
        "kfac/inverse_compute/fc2/G": (11220, 11520),
        "kfac/inverse_comm/failures": (11520, 12680),
        "kfac/iteration/all": (0, 12744),
    }
    for rank in (0, 1):
        _check(_spans(result.events, rank), expected)
    assert result.iteration_s == pytest.approx(12744e-6, abs=1e-9)
    assert result.breakdown["FactorComm"] == pytest.approx(1400e-6, abs=1e-9)


def test_one_rank_has_no_communication(two_layers: Workload, round_hardware: Hardware) -> None:
    # Forward/backward 7000 + factors 600 + four inverses 1200 + precondition 64 µs.
    result = simulate_strategy(two_layers, round_hardware, 1, "spd-kfac")
    assert result.iteration_s == pytest.approx(8864e-6, abs=1e-9)
    assert not [e for e in result.events if e.phase.endswith("_comm")]


def test_refresh_intervals_amortise(two_layers: Workload, round_hardware: Hardware) -> None:
    every = simulate_strategy(two_layers, round_hardware, 1, "d-kfac")
    amortised = simulate_strategy(
        two_layers, round_hardware, 1, "d-kfac", factor_update_steps=2, inv_update_steps=4
    )
    # Steps 0..3: (factors, inverses) = (yes, yes), (no, no), (yes, no), (no, no).
    # Without factors: 7000 + 64; factors only: 7600 + 64; both: 8864.
    expected = (8864 + 7064 + 7664 + 7064) / 4 * 1e-6
    assert every.iteration_s == pytest.approx(8864e-6, abs=1e-9)
    assert amortised.iteration_s == pytest.approx(expected, abs=1e-9)
    assert [kind.count for kind in amortised.kinds] == [1, 1, 2]


def test_custom_plan_replaces_the_placement(two_layers: Workload, round_hardware: Hardware) -> None:
    # Everything on rank 1, one broadcast per factor: rank 0 waits for four inversions.
    specs = [FactorSpec(name, kind, 2) for name in ("fc1", "fc2") for kind in ("A", "G")]
    plan = Plan("custom", 2, tuple(specs), (1, 1, 1, 1), (3e-4,) * 4)
    result = simulate_strategy(two_layers, round_hardware, 2, "mpd-kfac", plan=plan)
    spans0, spans1 = _spans(result.events, 0), _spans(result.events, 1)
    assert not any(name.startswith("kfac/inverse_compute/fc") for name in spans0)
    assert spans1["kfac/inverse_compute/fc2/G"] == [(13700.0, 14000.0)]
    with pytest.raises(ValueError, match="plan must cover"):
        simulate_strategy(
            two_layers, round_hardware, 2, "mpd-kfac", plan=replace(plan, world_size=3)
        )


def test_the_skip_flag_wait_has_a_span_counted_as_other(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    # Steps without a factor update agree on skipping with a one-element all-reduce:
    # 1000 + 4·10 = 1040 µs right after the step opens at 8920, as the real code's
    # flag_comm/skip span (step 0 updates factors, step 1 does not).
    result = simulate_strategy(
        two_layers, round_hardware, 2, "d-kfac", factor_update_steps=2, inv_update_steps=2
    )
    flags = [e for e in result.events if e.phase == Phase.FLAG_COMM]
    assert {e.name for e in flags} == {"kfac/flag_comm/skip"}
    assert len(flags) == 2  # one per rank, in the one iteration without factors
    assert all(e.duration == pytest.approx(1040e-6, abs=1e-9) for e in flags)
    kinds = {(kind.factor_step, kind.inverse_step): kind for kind in result.kinds}
    assert set(kinds) == {(True, True), (False, False)}
    # Counted as Other, where the step's time went before the wait had a span.
    assert kinds[False, False].breakdown["Other"] == pytest.approx(1040e-6, abs=1e-9)

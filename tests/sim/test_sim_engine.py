"""The discrete-event engine on hand-made programs."""

from __future__ import annotations

import pytest

from spdkfac.sim import Close, Collective, Compute, Issue, Open, Wait, simulate


def _collective(channel: str, alpha: float, work: float, ranks: int = 2) -> Collective:
    return Collective(f"{channel}", channel, tuple(range(ranks)), alpha, work)


def test_collective_starts_when_every_participant_issued() -> None:
    # rank 0 issues at 1, rank 1 at 3: start 3, α 0.5, work 1 -> ends 4.5. rank 0 waits 1-4.5.
    programs = [
        [Compute(1.0), Issue(0), Wait((0,), "kfac/factor_comm/wait")],
        [Compute(3.0), Issue(0), Wait((0,), "kfac/factor_comm/wait")],
    ]
    result = simulate(programs, [_collective("a", 0.5, 1.0)])
    assert result.starts == [3.0] and result.ends == [4.5]
    waits = {e.rank: (e.start, e.end) for e in result.events if e.name.endswith("wait")}
    assert waits == {0: (1.0, 4.5), 1: (3.0, 4.5)}
    assert result.finish == [4.5, 4.5]


def test_one_channel_is_fifo_in_issue_order() -> None:
    # Both issued at 0 on one channel: the second starts when the first ends.
    program = [Issue(0), Issue(1), Wait((0, 1))]
    result = simulate([program, program], [_collective("a", 1.0, 1.0), _collective("a", 1.0, 1.0)])
    assert result.starts == [0.0, 2.0] and result.ends == [2.0, 4.0]


def test_two_channels_share_the_link() -> None:
    # c0 (channel a) moves 1 s of work from 0; c1 (channel b) joins at 0.5. From 0.5 each
    # moves at half rate: c0 has 0.5 left -> ends 1.5; c1 then has 0.5 left at full rate
    # -> ends 2.0. Start-up time (α) uses no bandwidth: c2's α overlaps freely.
    programs = [
        [Issue(0), Compute(0.5), Issue(1), Wait((0, 1))],
        [Issue(0), Compute(0.5), Issue(1), Wait((0, 1))],
    ]
    result = simulate(programs, [_collective("a", 0.0, 1.0), _collective("b", 0.0, 1.0)])
    assert result.ends == [pytest.approx(1.5), pytest.approx(2.0)]
    latency = simulate(programs, [_collective("a", 0.0, 1.0), _collective("b", 0.6, 0.0)])
    assert latency.ends == [pytest.approx(1.0), pytest.approx(1.1)]


def test_spans_and_events() -> None:
    program = [Open("kfac/step/all"), Compute(2.0, "kfac/precondition/x"), Close("kfac/step/all")]
    result = simulate([program], [])
    names = {(e.name, e.start, e.duration) for e in result.events}
    assert names == {("kfac/step/all", 0.0, 2.0), ("kfac/precondition/x", 0.0, 2.0)}
    assert result.makespan == 2.0


def test_deadlock_and_malformed_programs_raise() -> None:
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([[Issue(0), Wait((0,))], [Wait((0,))]], [_collective("a", 0.0, 0.0)])
    with pytest.raises(ValueError, match="open spans"):
        simulate([[Open("kfac/step/all")]], [])
    with pytest.raises(ValueError, match="twice"):
        simulate([[Issue(0), Issue(0)]], [_collective("a", 0.0, 0.0, ranks=1)])
    with pytest.raises(ValueError, match="participants"):
        simulate([[Compute(1.0)]], [_collective("a", 0.0, 0.0, ranks=2)])


def test_overlap_slows_transfers_while_computing() -> None:
    # Work 1.0 issued at 0 while both ranks compute until 0.5. With overlap 0.5 it moves at
    # half rate until 0.5 (0.25 done), then at full rate: ends 0.5 + 0.75 = 1.25. With
    # overlap 0 nothing moves until 0.5: ends 1.5.
    program = [Issue(0), Compute(0.5), Wait((0,))]
    for overlap, end in ((1.0, 1.0), (0.5, 1.25), (0.0, 1.5)):
        result = simulate([program, program], [_collective("a", 0.0, 1.0)], overlap=overlap)
        assert result.ends == [pytest.approx(end)], overlap


def test_contention_slows_computation_while_transferring() -> None:
    # A 2 s transfer issued at 0 alongside 1 s of compute; contention 0.5 halves the
    # compute speed while the transfer moves, so the compute ends at 2.0; with overlap 0.5
    # too, the transfer moves at half rate while computing: 1.0 done by 2.0, then full
    # rate: ends 3.0.
    program = [Issue(0), Compute(1.0, "kfac/factor_compute/x/A"), Wait((0,))]
    result = simulate([program, program], [_collective("a", 0.0, 2.0)], contention=0.5)
    computes = [e for e in result.events if e.name == "kfac/factor_compute/x/A"]
    assert [(e.start, e.end) for e in computes] == [(0.0, pytest.approx(2.0))] * 2
    assert result.ends == [pytest.approx(2.0)]
    both = simulate([program, program], [_collective("a", 0.0, 2.0)], contention=0.5, overlap=0.5)
    assert both.ends == [pytest.approx(3.0)]
    with pytest.raises(ValueError, match="contention"):
        simulate([program, program], [_collective("a", 0.0, 2.0)], contention=1.0)


def test_rate_changes_never_finish_the_wrong_computation() -> None:
    # Transfer of work 1 from 0 to 1; contention 0.5 halves compute until then. Compute 1
    # (1 s) has 0.5 left at t = 1 and ends 1.5; compute 2 runs 1.5-2.5; compute 3 2.5-3.5.
    # Stale completion events of an earlier computation must not end a later one.
    names = ["kfac/precondition/a", "kfac/precondition/b", "kfac/precondition/c"]
    program = [Issue(0), *(Compute(1.0, name) for name in names), Wait((0,))]
    result = simulate([program, program], [_collective("a", 0.0, 1.0)], contention=0.5)
    spans = sorted((e.start, e.end) for e in result.events if e.rank == 0)
    assert spans == [
        (0.0, pytest.approx(1.5)),
        (1.5, pytest.approx(2.5)),
        (2.5, pytest.approx(3.5)),
    ]

"""The factor exchange: bucket layout, launch order, weighted averaging (no processes)."""

from __future__ import annotations

import torch

from distributed_helper import RecordingCommunicator
from spdkfac.comm import LocalCommunicator
from spdkfac.comm.exchange import FactorExchange
from spdkfac.linalg import pack_triu, packed_size
from spdkfac.planning.fusion import FusionPlan, plan_threshold


def _sym(dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(dim + 2, dim, generator=torch.Generator().manual_seed(seed))
    return (x.T @ x).double()


SLOTS = [("a/A", 4), ("b/A", 3), ("b/G", 2), ("a/G", 5)]


def test_buckets_follow_the_plan() -> None:
    sizes = {key: packed_size(dim) for key, dim in SLOTS}
    plan = plan_threshold(["a/A", "b/A"], ["b/G", "a/G"], sizes, bucket_cap_elements=16)
    exchange = FactorExchange(LocalCommunicator(), SLOTS, plan)
    # Packed sizes 10 + 6 fit the cap; 3 + 15 do not.
    assert plan.buckets == (("a/A", "b/A"), ("b/G",), ("a/G",))
    assert exchange.bucket_sizes == (16, 3, 15)


def test_eager_buckets_launch_in_plan_order_whatever_the_hook_order() -> None:
    plan = FusionPlan("test", (("a/A",), ("b/A",), ("b/G", "a/G")), eager=True)
    comm = RecordingCommunicator(LocalCommunicator())
    exchange = FactorExchange(comm, SLOTS, plan, dtype=torch.float64)
    exchange.add("b/A", _sym(3, 1), 2.0)  # bucket 1 complete, bucket 0 not: held back
    assert comm.log == []
    exchange.add("a/A", _sym(4, 0), 2.0)  # now buckets 0 and 1 go, in order
    assert [numel for _, numel, _ in comm.log] == [10, 6]
    exchange.add("a/G", _sym(5, 3), 2.0)  # bucket 2 still misses b/G
    assert len(comm.log) == 2
    assert exchange.add("a/G", _sym(5, 3), 2.0) is False  # a second contribution is ignored
    result = exchange.finish(local_ok=True).wait()
    # Bucket 2 (with b/G as zeros), then one tensor of weights, grown flags and the
    # gradient flag.
    assert [numel for _, numel, _ in comm.log] == [10, 6, 18, 2 * len(SLOTS) + 1]
    assert result.factors["b/G"] is None and result.usable
    # Factors stay packed: unpacking is for the ranks that invert them.
    torch.testing.assert_close(result.factors["a/G"], pack_triu(_sym(5, 3)))


def test_grown_and_late_slots_come_back_to_be_revised_then_are_forgotten() -> None:
    plan = FusionPlan("test", (("a/A", "b/A"), ("b/G", "a/G")), eager=True)
    exchange = FactorExchange(LocalCommunicator(), SLOTS, plan, dtype=torch.float64)
    exchange.add("a/A", _sym(4, 0), 1.0)
    exchange.flush(0)  # bucket 0 leaves without b/A
    exchange.add("b/A", _sym(3, 1), 1.0)  # late: ignored this exchange
    result = exchange.finish(local_ok=True, grown=["a/G"]).wait()
    assert result.revise == ("b/A", "a/G")  # in slot-layout order
    assert result.factors["b/A"] is None
    exchange.add("a/A", _sym(4, 0), 1.0)
    assert exchange.finish(local_ok=True).wait().revise == ()


def test_weighted_average_flags_and_reuse_across_steps() -> None:
    plan = FusionPlan("test", (("a/A", "b/A", "b/G", "a/G"),), eager=False)
    exchange = FactorExchange(LocalCommunicator(), SLOTS, plan, dtype=torch.float64)
    a = _sym(4, 0)
    exchange.add("a/A", a, 5.0)
    result = exchange.finish(local_ok=False).wait()
    torch.testing.assert_close(result.factors["a/A"], pack_triu(a))
    assert result.flagged_ranks == 1 and not result.usable
    # The next step starts from clean buffers.
    exchange.add("b/A", _sym(3, 9), 1.0)
    result = exchange.finish(local_ok=True).wait()
    assert result.factors["a/A"] is None and result.usable
    bad = a.clone()
    bad[0, 0] = float("nan")
    exchange.add("a/A", bad, 1.0)
    assert not exchange.finish(local_ok=True).wait().finite


def test_bfloat16_transport_keeps_float32_results() -> None:
    plan = FusionPlan("test", (("a/A", "b/A", "b/G", "a/G"),), eager=False)
    exchange = FactorExchange(
        LocalCommunicator(), SLOTS, plan, dtype=torch.float32, comm_dtype=torch.bfloat16
    )
    a = _sym(4, 0).float()
    exchange.add("a/A", a, 3.0)
    factor = exchange.finish().wait().factors["a/A"]
    assert factor is not None and factor.dtype == torch.float32
    torch.testing.assert_close(factor, pack_triu(a), rtol=1e-2, atol=1e-2)

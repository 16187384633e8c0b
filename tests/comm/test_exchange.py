"""The factor exchange's bucket layout and weighted averaging (no processes needed)."""

from __future__ import annotations

import torch

from spdkfac.comm import LocalCommunicator
from spdkfac.comm.exchange import FactorExchange
from spdkfac.linalg import packed_size


def _sym(dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(dim + 2, dim, generator=torch.Generator().manual_seed(seed))
    return x.T @ x


def test_buckets_cover_every_slot_once_and_respect_the_cap() -> None:
    slots = [(f"l{i}/A", d) for i, d in enumerate([3, 10, 4, 30, 2, 2])]
    cap_elements = 60
    exchange = FactorExchange(LocalCommunicator(), slots, bucket_cap_bytes=4 * cap_elements)
    sizes = exchange.bucket_sizes
    payload = sum(packed_size(d) for _, d in slots)
    assert sum(sizes) == payload + len(slots) + 1  # factors + weights + flag
    # The 30-dim factor (465 elements) exceeds the cap and travels alone.
    assert len(sizes) > 1 and packed_size(30) in sizes


def test_weighted_average_and_missing_slots() -> None:
    slots = [("a/A", 4), ("a/G", 3), ("b/A", 2)]
    exchange = FactorExchange(LocalCommunicator(), slots, dtype=torch.float64)
    a, g = _sym(4, 0).double(), _sym(3, 1).double()
    result = exchange.start({"a/A": (a, 5.0), "a/G": (g, 5.0)}, flagged=True).wait()
    torch.testing.assert_close(result.factors["a/A"], a)
    torch.testing.assert_close(result.factors["a/G"], g)
    assert result.factors["b/A"] is None
    assert result.flagged_ranks == 1

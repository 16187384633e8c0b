"""Running factors kept packed in a group: averaged as triangles, unpacked only to invert,
full matrices at every public edge (``factors()``, the state dict)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.comm import LocalCommunicator
from spdkfac.comm.exchange import FactorExchange
from spdkfac.curvature import KroneckerBlock, blocks_memory
from spdkfac.curvature.state import symmetric_running_average
from spdkfac.engine import inversion
from spdkfac.layers import lookup
from spdkfac.linalg import pack_triu, packed_size
from spdkfac.planning.fusion import FusionPlan
from spdkfac.planning.placement import EVERY_RANK


def _symmetric(dim: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(dim + 2, dim, generator=generator, dtype=torch.float64)
    product = x.T @ x
    return (product + product.T) / 2  # exactly symmetric on any CPU (XᵀX need not be)


def test_packed_running_average_is_the_full_one() -> None:
    full: Tensor | None = None
    packed: Tensor | None = None
    for step, decay in enumerate([0.95, 0.95, 0.5, 1.0, 0.9]):
        new = _symmetric(7, step)
        full = symmetric_running_average(full, new, decay)
        packed = symmetric_running_average(packed, pack_triu(new), decay)
        assert packed.shape == (packed_size(7),) and full.shape == (7, 7)
    assert full is not None and packed is not None
    # Elementwise on the same numbers; not asserted bitwise, since a vectorized loop and
    # its scalar tail may round a multiply-add differently on some CPUs.
    torch.testing.assert_close(packed, pack_triu(full), rtol=1e-14, atol=0)


def test_a_restored_full_factor_is_packed_once_by_the_next_packed_update() -> None:
    current = _symmetric(5, 0)
    new = _symmetric(5, 1)
    averaged = symmetric_running_average(current.clone(), pack_triu(new), 0.9)
    torch.testing.assert_close(averaged, pack_triu(0.9 * current + 0.1 * new))
    # and the other way (a state saved by a group, loaded in a group of one)
    unpacked = symmetric_running_average(pack_triu(current), new, 0.9)
    assert unpacked.shape == (5, 5) and torch.equal(unpacked, unpacked.T)


def _block() -> KroneckerBlock:
    module = nn.Linear(4, 3).double()
    adapter = lookup(module)
    assert adapter is not None
    return KroneckerBlock("fc", module, adapter)


def _statistics(block: KroneckerBlock, seed: int, packed: bool) -> dict[str, Tensor]:
    a, g = _symmetric(block.a_dim, seed), _symmetric(block.g_dim, seed + 50)
    if packed:
        a, g = pack_triu(a), pack_triu(g)
    return {"fc/A": a, "fc/G": g}


def test_a_block_keeps_packed_factors_and_shows_full_ones() -> None:
    block, reference = _block(), _block()
    for step in range(3):
        block.absorb(_statistics(block, step, packed=True), 0.9)
        reference.absorb(_statistics(reference, step, packed=False), 0.9)
    stored = block.stored()
    assert stored["a_factor"] is not None and stored["a_factor"].shape == (packed_size(5),)
    assert set(block.placed_factors()) == {"fc/A", "fc/G"}
    assert all(factor.dim() == 1 for factor in block.placed_factors().values())
    for shown, expected in zip(block.factors(), reference.factors(), strict=True):
        assert shown is not None and expected is not None and shown.shape == expected.shape
        torch.testing.assert_close(shown, expected, rtol=1e-14, atol=0)
        assert torch.equal(shown, shown.T)
    state = block.state()
    assert state["a_factor"] is not None and state["a_factor"].shape == (5, 5)
    # memory_bytes counts what is held: the triangles.
    assert blocks_memory([block])["factors"] == 8 * (packed_size(5) + packed_size(3))
    assert blocks_memory([reference])["factors"] == 8 * (5 * 5 + 3 * 3)


def test_state_round_trips_bit_identically_through_full_matrices() -> None:
    block = _block()
    for step in range(2):
        block.absorb(_statistics(block, step, packed=True), 0.9)
    saved = block.state()
    restored = _block()
    restored.restore({key: None if v is None else v.clone() for key, v in saved.items()})
    again = restored.state()
    assert all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(saved.values(), again.values(), strict=True)
    )
    # Both continue identically: the full restored factor is packed back bit for bit.
    block.absorb(_statistics(block, 7, packed=True), 0.9)
    restored.absorb(_statistics(restored, 7, packed=True), 0.9)
    for key in ("a_factor", "g_factor"):
        assert torch.equal(restored.stored()[key], block.stored()[key])  # type: ignore[arg-type]


def test_the_exchange_hands_packed_copies_that_outlive_the_step() -> None:
    slots = [("a/A", 4), ("a/G", 3)]
    plan = FusionPlan("test", (("a/A", "a/G"),), eager=False)
    exchange = FactorExchange(LocalCommunicator(), slots, plan, dtype=torch.float64)
    exchange.add("a/A", _symmetric(4, 0), 2.0)
    exchange.add("a/G", _symmetric(3, 1), 2.0)
    factors = exchange.finish().wait().factors
    kept = {key: None if f is None else f.clone() for key, f in factors.items()}
    assert all(f is not None and f.dim() == 1 for f in factors.values())
    exchange.add("a/A", torch.zeros(4, 4, dtype=torch.float64), 1.0)  # reuses the buckets
    exchange.finish().wait()
    assert all(torch.equal(factors[key], kept[key]) for key in factors)  # type: ignore[arg-type]


# ---------------------------------------------------------------- two real ranks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def _unpacks_worker(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    unpacked: list[int] = []
    real = inversion.unpack_triu

    def recording(packed: Tensor, dim: int, **kwargs: Tensor) -> Tensor:
        unpacked.append(id(packed))
        return real(packed, dim, **kwargs)

    inversion.unpack_triu = recording  # type: ignore[assignment]  # (a spawned process)
    model = _mlp()
    precond = KFACPreconditioner(
        model, strategy=strategy, kl_clip=None, damping=0.1, inv_update_steps=1
    )  # the last step's inverse phase unpacks what this rank inverts
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        generator = torch.Generator().manual_seed(10 * step + rank)
        inputs = torch.randn(4, 6, generator=generator)
        targets = torch.randint(0, 3, (4,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        for param in model.parameters():  # no DDP: average the gradients here
            assert param.grad is not None
            torch.distributed.all_reduce(param.grad)
            param.grad.div_(world_size)
        unpacked.clear()  # keep the last inverse phase only
        assert precond.step()
        optimizer.step()
    blocks: Mapping[str, KroneckerBlock] = {b.name: b for b in precond._blocks}  # type: ignore[misc]
    owner = precond.plan.owner_by_key
    return {
        "unpacked": sorted(
            f"{name}/{kind}"
            for name, block in blocks.items()
            for kind, factor in (("A", block.a_factor), ("G", block.g_factor))
            if id(factor) in unpacked
        ),
        "inverted_here": sorted(
            key for key, rank_of in owner.items() if rank_of in (rank, EVERY_RANK)
        ),
        "packed": all(
            f is not None and f.dim() == 1
            for b in blocks.values()
            for f in (b.a_factor, b.g_factor)
        ),
        "factors": {name: precond.factors(name) for name in precond.layers},
        "memory": precond.memory_bytes()["factors"],
    }


@pytest.mark.parametrize("strategy", ["mpd-kfac", "spd-kfac"])
def test_a_rank_unpacks_only_the_factors_it_inverts(strategy: str) -> None:
    results = run_distributed(_unpacks_worker, 2, strategy)
    dims = [(7, 8), (9, 5), (6, 3)]  # (A with the bias column, G) per layer
    packed_bytes = 4 * sum(packed_size(a) + packed_size(g) for a, g in dims)
    for result in results:
        assert result["packed"] and result["memory"] == packed_bytes
        assert result["unpacked"] == result["inverted_here"]
    if strategy == "mpd-kfac":  # round-robin: each rank inverts (and unpacks) half
        assert not set(results[0]["unpacked"]) & set(results[1]["unpacked"])
    for name, (a_factor, g_factor) in results[0]["factors"].items():
        other_a, other_g = results[1]["factors"][name]
        assert a_factor.shape == (a_factor.shape[0],) * 2 and torch.equal(a_factor, other_a)
        assert torch.equal(g_factor, other_g)

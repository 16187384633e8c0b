"""Osawa et al.'s owner-computes exchange (``strategy="osawa"``): the same training as the
replicated strategies and as single-process K-FAC, with each factor held by one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import RecordingCommunicator, run_distributed
from parallel_cases import Branchy, batch, bounds, params
from spdkfac import KFACPreconditioner
from spdkfac.comm import TorchDistributedCommunicator
from spdkfac.linalg import packed_size
from spdkfac.strategies import STRATEGIES

STEPS = 5
OSAWA = ("osawa", "osawa-pipelined")


class _Net(nn.Module):
    """Conv, GroupNorm (unit-wise curvature), a depthwise conv, an MLP head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.depthwise = nn.Conv2d(4, 4, 3, groups=4, bias=False)
        self.fc1 = nn.Linear(4 * 4 * 4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.depthwise(torch.tanh(self.norm(self.conv(x)))))
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double()


def _options(**extra: Any) -> dict[str, Any]:
    return {"damping": 0.05, "kl_clip": 1e-2, "lr": 0.1, "normalization": "unit-wise", **extra}


def _train(
    rank: int,
    world_size: int,
    strategy: str,
    *,
    ddp: bool,
    uneven: bool = False,
    refresh: tuple[int, int] = (1, 1),
) -> dict[str, Tensor]:
    """``STEPS`` SGD steps; gradients averaged by DDP, by hand (replicated strategies
    without DDP) or by the preconditioner (osawa without DDP)."""
    model = _model()
    net: nn.Module = DistributedDataParallel(model) if ddp and world_size > 1 else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    row = STRATEGIES[strategy].options
    assert row is not None
    # The clip only with stale refreshes: an active clip hides a wrong gradient scale.
    options = _options(factor_update_steps=refresh[0], inv_update_steps=refresh[1])
    if refresh == (1, 1):
        options["kl_clip"] = None
    precond = KFACPreconditioner(net, **row, **options)
    begin, end = bounds(rank, world_size, uneven)
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, targets = batch(step)
        F.cross_entropy(net(inputs[begin:end]), targets[begin:end]).backward()
        if world_size > 1 and not ddp and not strategy.startswith("osawa"):
            for param in net.parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)
                param.grad /= world_size
        assert precond.step()
        optimizer.step()
    return params(model)


#: (strategy, DDP, refresh or "uneven") runs per world size; world 3 repeats a subset.
CASES = {
    2: [
        (strategy, ddp, refresh)
        for ddp in (True, False)
        for refresh in ((1, 1), (2, 3))
        for strategy in ("d-kfac", *OSAWA)
    ]
    + [(s, ddp, "uneven") for s in ("d-kfac", "osawa") for ddp in (True, False)],
    3: [
        ("osawa", True, (2, 3)),
        ("osawa-pipelined", False, (1, 1)),
        ("d-kfac", True, "uneven"),
        ("osawa", False, "uneven"),
    ],
}


def _equality_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, ddp, refresh in CASES[world_size]:
        out[f"{strategy}/{ddp}/{refresh}"] = (
            _train(rank, world_size, strategy, ddp=ddp, uneven=True)
            if refresh == "uneven"
            else _train(rank, world_size, strategy, ddp=ddp, refresh=refresh)
        )
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_osawa_trains_like_single_process_kfac(world_size: int) -> None:
    """Parameters after 5 steps equal single-process K-FAC on the concatenated batch
    (float64), with and without DDP, for every refresh schedule; equal to D-KFAC with
    uneven batches (where DDP's average of per-rank means is the reference)."""
    results = run_distributed(_equality_worker, world_size, timeout=240)
    references = {r: _train(0, 1, "d-kfac", ddp=False, refresh=r) for r in ((1, 1), (2, 3))}
    for strategy, ddp, refresh in CASES[world_size]:
        key = f"{strategy}/{ddp}/{refresh}"
        expected = results[0]["d-kfac/True/uneven"] if refresh == "uneven" else references[refresh]
        for rank, out in enumerate(results):
            for name, value in out[key].items():
                torch.testing.assert_close(
                    value, expected[name], rtol=1e-9, atol=1e-12, msg=f"{key} {name} rank {rank}"
                )
                # Replicas are bit-identical: every rank applies the gathered update.
                assert torch.equal(value, results[0][key][name]), (key, name, rank)


def _unused_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, ddp in (("d-kfac", True), ("osawa", True), ("osawa", False)):
        torch.manual_seed(0)
        model = Branchy().double()
        net: nn.Module = (
            DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
        )
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        precond = KFACPreconditioner(net, strategy=strategy, damping=0.1, kl_clip=None)
        for step in range(3):
            optimizer.zero_grad()
            generator = torch.Generator().manual_seed(10 * step + rank)
            inputs = torch.randn(4, 4, dtype=torch.float64, generator=generator)
            # The side branch runs on rank 0 only.
            net(inputs, use_side=(rank == 0)).pow(2).mean().backward()
            assert precond.step()
            optimizer.step()
        out[f"{strategy}/{ddp}"] = params(model)
    return out


def test_layer_unused_on_one_rank() -> None:
    results = run_distributed(_unused_worker, 2, timeout=120)
    expected = results[0]["d-kfac/True"]
    for out in results:
        for key in ("osawa/True", "osawa/False"):
            for name, value in out[key].items():
                torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12)


def _state_worker(rank: int, world_size: int, path: str, phase: str) -> dict[str, Any]:
    """Phase "save": 3 steps at this world size, save; "resume": load and take 2 steps."""
    model = _model()
    net = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    precond = KFACPreconditioner(net, strategy="osawa", **_options())
    out: dict[str, Any] = {}
    begin, end = bounds(rank, world_size)
    steps = range(3)
    if phase == "resume":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        precond.load_state_dict(saved["precond"])
        out["reloaded"] = precond.state_dict()  # a collective: every rank calls it
        steps = range(3, 5)
    for step in steps:
        optimizer.zero_grad()
        inputs, targets = batch(step)
        F.cross_entropy(net(inputs[begin:end]), targets[begin:end]).backward()
        assert precond.step()
        optimizer.step()
    state = precond.state_dict()
    out["state"] = state
    out["memory"] = precond.memory_bytes()
    out["params"] = params(model)
    if phase == "save" and rank == 0:
        torch.save({"model": model.state_dict(), "precond": state}, path)
    return out


def test_state_dict_round_trips_and_resumes_on_another_world_size(tmp_path: Path) -> None:
    path = str(tmp_path / "state.pt")
    saved = run_distributed(_state_worker, 2, path, "save", timeout=120)
    # Every rank returns the full state, bit-identical, although each holds only its own.
    for out in saved[1:]:
        _assert_states_equal(out["state"], saved[0]["state"])
    memories = [out["memory"]["inverses"] for out in saved]
    resumed = run_distributed(_state_worker, 3, path, "resume", timeout=120)
    for out in resumed:
        _assert_states_equal(out["reloaded"], saved[0]["state"])
    # Resuming equals training uninterrupted (single process, float64).
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, strategy="d-kfac", **_options())
    for step in range(5):
        optimizer.zero_grad()
        inputs, targets = batch(step)
        F.cross_entropy(model(inputs), targets).backward()
        assert precond.step()
        optimizer.step()
    for out in resumed:
        for name, value in model.named_parameters():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-9, atol=1e-12)
    full = precond.memory_bytes()["inverses"]
    # Each Kronecker block's inverses are held by one rank; norm and depthwise blocks' by
    # all. (Inverses: how factors are stored may differ between one and several ranks.)
    assert max(memories) < full < sum(memories)


def _assert_states_equal(state: dict[str, Any], expected: dict[str, Any]) -> None:
    assert state["steps"] == expected["steps"]
    for section in ("layers",):
        for layer, entry in expected[section].items():
            for key, value in entry.items():
                got = state[section][layer][key]
                assert (got is None) == (value is None), (layer, key)
                if value is not None:
                    assert torch.equal(got, value), (layer, key)


class _Shapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def _collectives_worker(rank: int, world_size: int, strategy: str) -> list[tuple[str, int, str]]:
    torch.manual_seed(0)
    model = _Shapes()
    log: list[tuple[str, int, str]] = []
    precond = KFACPreconditioner(
        model,
        strategy=strategy,
        kl_clip=1e-3,
        lr=0.1,
        inv_update_steps=1,  # the byte formula counts an inverse phase at every step
        process_group=RecordingCommunicator(TorchDistributedCommunicator(), log),
    )
    for step in range(2):
        log.append((f"step {step}", 0, ""))
        model.zero_grad()
        inputs = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank + 10 * step))
        model(inputs).pow(2).mean().backward()
        if strategy != "osawa":
            for param in model.parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)  # not through the recorded group
                param.grad /= world_size
        assert precond.step()
    return log


def test_recorded_collectives_match_the_byte_formula() -> None:
    """Layer a: ∇ 7x6 (weight and bias), A 6x6, G 7x7; layer b: ∇ 3x7, A 7x7, G 3x3.
    Per step (docs/guide.md, "Bytes per step"): osawa reduce-scatters the gradients
    (W = 42 + 21 elements) and the packed factors (F = 21 + 28 + 28 + 6), and
    all-gathers the preconditioned gradients (W, one broadcast per owner); D-KFAC
    all-reduces F (the gradients are the caller's, here outside the recorded group)."""
    logs = {s: run_distributed(_collectives_worker, 2, s, timeout=120) for s in ("osawa", "d-kfac")}
    for log in logs.values():
        assert log[0] == log[1]  # the same collectives, in the same order, on both ranks
    f32, f64 = "torch.float32", "torch.float64"
    # The plan: a (more work) on rank 0, b on rank 1; chunks are (rank 0's, rank 1's).
    osawa = [
        ("reduce_scatter(42,21)", 63, f32),  # gradients to owners
        ("all_reduce_sum", 3, f32),  # which parameters have a gradient (no DDP)
        ("reduce_scatter(21,28)", 49, f32),  # A bucket: a/A to rank 0, b/A to rank 1
        ("reduce_scatter(28,6)", 34, f32),  # G bucket
        ("all_reduce_sum", 9, f64),  # slot weights, grown-slot flags, non-finite flag
        ("all_reduce_max", 1, f32),  # every owner's factors finite
        ("all_reduce_max", 4, f32),  # inversion failures
        ("all_reduce_sum", 4, f64),  # KL sum, skip flag, owned layers with a gradient
        ("broadcast(src=0)", 42, f32),  # all-gather of the preconditioned gradients
        ("broadcast(src=1)", 21, f32),
    ]
    d_kfac = [
        ("all_reduce_sum", 49, f32),
        ("all_reduce_sum", 34, f32),
        ("all_reduce_sum", 9, f64),
        ("all_reduce_max", 4, f32),
    ]
    for strategy, expected in (("osawa", osawa), ("d-kfac", d_kfac)):
        log = logs[strategy][0]
        assert log[log.index(("step 1", 0, "")) + 1 :] == expected, strategy
        assert log[log.index(("step 0", 0, "")) + 1 : log.index(("step 1", 0, ""))] == expected
    weights = 7 * 6 + 3 * 7
    factors = packed_size(6) + packed_size(7) + packed_size(7) + packed_size(3)
    scattered = sum(n for op, n, _ in osawa if op.startswith("reduce_scatter"))
    gathered = sum(n for op, n, _ in osawa if op.startswith("broadcast"))
    assert (scattered, gathered) == (weights + factors, weights)


def _gpt_run(rank: int, world_size: int, strategy: str, accumulation: int) -> dict[str, Tensor]:
    """A tiny GPT (embedding, tied head, LayerNorm) under DDP, with gradient accumulation
    through ``no_sync``."""
    from spdkfac.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8).double()
    net = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        net,
        strategy=strategy,
        damping=0.1,
        kl_clip=None,  # an active clip would hide a wrong gradient scale
        normalization="diagonal",
        accumulation_steps=accumulation,
    )
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(accumulation):
            generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            tokens = torch.randint(0, 11, (2, 7), generator=generator)
            context = net.no_sync() if micro < accumulation - 1 else torch.enable_grad()
            with context:
                logits = net(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))
                (loss / accumulation).backward()
        assert precond.step()
        optimizer.step()
    return params(model)


def _edges_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("d-kfac", "osawa"):
        out[f"gpt/{strategy}"] = _gpt_run(rank, world_size, strategy, accumulation=2)
    # A non-finite gradient on rank 1 only: every rank skips, on factor steps and others.
    model = _model()
    precond = KFACPreconditioner(model, strategy="osawa", factor_update_steps=2, **_options())
    skipped = []
    for step in range(4):
        model.zero_grad()
        inputs, targets = batch(step)
        if rank == 1 and step in (1, 2):
            inputs = inputs * float("nan")
        F.cross_entropy(model(inputs[:4]), targets[:4]).backward()
        skipped.append(not precond.step())
    out["skipped"] = skipped
    # A DDP model that already has a communication hook cannot take the owners' one.
    net = DistributedDataParallel(_model())
    net.register_comm_hook(None, lambda _state, bucket: torch.futures.Future())
    try:
        KFACPreconditioner(net, strategy="osawa")
    except ValueError as error:
        out["hooked"] = str(error)
    return out


def test_embeddings_tied_head_accumulation_skips_and_hooks() -> None:
    results = run_distributed(_edges_worker, 2, timeout=180)
    for out in results:
        for name, value in out["gpt/osawa"].items():
            torch.testing.assert_close(
                value, results[0]["gpt/d-kfac"][name], rtol=1e-9, atol=1e-12, msg=name
            )
        assert out["skipped"] == [False, True, True, False]
        assert "communication hook" in out["hooked"]


def test_osawa_needs_a_placement_that_owns_layers() -> None:
    with pytest.raises(
        ValueError, match="placement='balanced' cannot be used with strategy='osawa'"
    ):
        KFACPreconditioner(nn.Linear(2, 2), strategy="osawa", placement="balanced")

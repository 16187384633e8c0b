"""Distributed consistency (docs/reliability.md D1, D3, D4, D6, D7): no hang, one result.

Most runs happen under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which wraps every process group
in torch's ProcessGroupWrapper: before each collective the ranks compare its op, sequence
number, shapes and dtypes, and a difference raises "Collectives differ…" on every rank
instead of hanging or silently mixing tensors.

DDP is not used under DETAIL: on torch 2.13 (CPU build), constructing
``DistributedDataParallel`` over gloo with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` segfaults the
worker. The DETAIL runs therefore average gradients with one explicit all-reduce (what DDP
with ``find_unused_parameters=True`` does, weighted by each rank's examples), and the DDP
variant of D4 runs without DETAIL.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import RecordingCommunicator, run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.comm import TorchDistributedCommunicator, completed

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac")
VARIANTS = ("plain", "hook-order", "unused", "eval-forwards")
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
#: Two periods of the refresh intervals (2 and 3: every combination of factor, inverse and
#: plain steps twice), past UNUSED_EVERYWHERE.
STEPS = 12
ACCUMULATION = 2
UNUSED_EVERYWHERE = 10  # a factor step (interval 2) at which no rank runs the side branch


class _Branches(nn.Module):
    """A stem, two parallel branches (order switchable), an optional side layer, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.left = nn.Linear(6, 5)
        self.right = nn.Linear(6, 5, bias=False)
        self.side = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)
        self.right_first = False
        self.use_side = True

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.stem(x))
        if self.right_first:
            right = self.right(x)
            left = self.left(x)
        else:
            left = self.left(x)
            right = self.right(x)
        hidden = torch.tanh(left + right)
        if self.use_side:
            hidden = hidden + torch.tanh(self.side(hidden))
        return self.head(hidden)


def _model() -> _Branches:
    torch.manual_seed(0)
    return _Branches().double()


def _batch(rank: int, step: int, size: int = 6) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(size, 4, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (size,), generator=generator)


def _options(strategy: str) -> dict[str, object]:
    return {
        "strategy": strategy,
        "damping": 0.05,
        "kl_clip": 1e-2,
        "lr": 0.1,
        "factor_update_steps": 2,  # co-prime refresh intervals: every combination occurs
        "inv_update_steps": 3,
        "fusion_warmup_steps": 2,  # spd-kfac re-plans its buckets (a broadcast) mid-run
    }


def _average_gradients(model: nn.Module, examples: int) -> None:
    """DDP with ``find_unused_parameters`` by hand, weighted by each rank's examples: a
    parameter unused on this rank contributes zeros. One all-reduce, so DETAIL can check it."""
    parameters = list(model.parameters())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
    count = torch.tensor([float(examples)], dtype=torch.float64)
    flat = torch.cat([g.flatten() * examples for g in grads] + [count])
    dist.all_reduce(flat)
    total, offset = flat[-1], 0
    for parameter in parameters:
        size = parameter.numel()
        parameter.grad = (flat[offset : offset + size] / total).view_as(parameter)
        offset += size


def _logging_forwards(
    model: nn.Module, inputs: Tensor, log: list[object], quiet: list[int]
) -> None:
    """Rank 0's evaluation forwards: eval mode with autograd on, then train mode under
    ``no_grad``. They must not issue a collective (recorded in ``quiet``)."""
    before, training = len(log), model.training
    model.eval()
    model(inputs)
    model.train(training)
    with torch.no_grad():
        model(inputs)
    quiet.append(len(log) - before)


def _train(rank: int, strategy: str, variant: str) -> dict[str, object]:
    model = _model()
    model.right_first = variant == "hook-order" and rank == 1  # D3: rank-dependent hook order
    log: list[tuple[str, int, str]] = []
    precond = KFACPreconditioner(
        model,
        accumulation_steps=ACCUMULATION,
        process_group=RecordingCommunicator(TorchDistributedCommunicator(), log),
        **_options(strategy),  # type: ignore[arg-type]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    quiet: list[int] = []
    side_factors: list[Tensor | None] = []
    eval_rank = variant == "eval-forwards" and rank == 0  # D6: on rank 0 only
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        for index, part in enumerate(torch.chunk(torch.arange(len(targets)), ACCUMULATION)):
            if variant == "unused":
                # D4: rank 1 skips the side layer in every pass, in the last pass only, or
                # not at all, depending on the step; at one factor step every rank skips it.
                passes = {0: ACCUMULATION, 1: ACCUMULATION - 1, 2: 0}[step % 3]
                model.use_side = step != UNUSED_EVERYWHERE and (rank == 0 or index < passes)
            if eval_rank:
                _logging_forwards(model, inputs, log, quiet)
            loss = F.cross_entropy(model(inputs[part]), targets[part]) / ACCUMULATION
            if eval_rank:
                _logging_forwards(model, inputs, log, quiet)
            loss.backward()
        if eval_rank:
            _logging_forwards(model, inputs, log, quiet)
        _average_gradients(model, len(targets))
        assert precond.step(), step
        optimizer.step()
        if eval_rank:
            _logging_forwards(model, inputs, log, quiet)
        side_a, _ = precond.factors("side")
        side_factors.append(None if side_a is None else side_a.clone())
    return {
        "factors": {name: precond.factors(name) for name in precond.layers},
        "inverses": {name: precond.inverses(name) for name in precond.layers},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "counters": (precond.steps, precond.skipped_steps),
        "log": log,
        "quiet": quiet,
        "side": side_factors,
    }


def _last_batch_shards(rank: int) -> list[tuple[Tensor, Tensor]]:
    """Rank 0 holds 7 examples, rank 1 holds 5; batch 4: batches of 4+3 and 4+1 examples."""
    generator = torch.Generator().manual_seed(50 + rank)
    count = 7 if rank == 0 else 5
    inputs = torch.randn(count, 4, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (count,), generator=generator)
    return [(inputs[i : i + 4], targets[i : i + 4]) for i in range(0, count, 4)]


def _smaller_last_batch(rank: int, strategy: str) -> dict[str, object]:
    model = _model()
    # Factors every step, so the smaller batches reach them.
    options = {**_options(strategy), "factor_update_steps": 1}
    precond = KFACPreconditioner(model, **options)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _epoch in range(2):
        for inputs, targets in _last_batch_shards(rank):
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            _average_gradients(model, len(targets))
            assert precond.step()
            optimizer.step()
    return {
        "factors": {name: precond.factors(name) for name in precond.layers},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _detail_cases() -> list[tuple[str, str]]:
    """(strategy, variant) runs under DETAIL. Not spd-kfac with a layer unused on one rank:
    its pipelined buckets launch from hooks, and the bucket holding that layer's factors
    launches during backward on the rank that used it but only in ``step()`` on the other.
    Without DETAIL launches are asynchronous and ordered per group, so nothing waits; DETAIL
    makes each launch wait for the peers, so the first rank would wait in backward while its
    peer waits in the gradient all-reduce (a DETAIL-only stall). That case runs without
    DETAIL below."""
    return [
        (strategy, variant)
        for strategy in STRATEGIES
        for variant in VARIANTS
        if (strategy, variant) != ("spd-kfac", "unused")
    ]


def _detail_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {"detail": dist.get_debug_level() == dist.DebugLevel.DETAIL}
    for strategy, variant in _detail_cases():
        out[f"{strategy}/{variant}"] = _train(rank, strategy, variant)
    for strategy in STRATEGIES:
        out[f"{strategy}/last-batch"] = _smaller_last_batch(rank, strategy)
    return out


@pytest.fixture(scope="module")
def detail_runs() -> list[dict[str, object]]:
    """Every strategy and variant on 2 ranks under DETAIL (one launch for the module)."""
    return run_distributed(_detail_worker, 2, timeout=240, env=DETAIL)


def _plain_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {"spd-kfac/unused": _train(rank, "spd-kfac", "unused")}
    # D4 with DDP (find_unused_parameters): the side layer is unused on rank 1 at odd steps.
    base = _model()
    model = DistributedDataParallel(base, find_unused_parameters=True)
    precond = KFACPreconditioner(model, **_options("spd-kfac"))  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        optimizer.zero_grad()
        base.use_side = rank == 0 or step % 2 == 0
        inputs, targets = _batch(rank, step)
        F.cross_entropy(model(inputs), targets).backward()
        assert precond.step()
        optimizer.step()
    out["ddp"] = {
        "params": {n: p.detach().clone() for n, p in base.named_parameters()},
        "factors": {name: precond.factors(name) for name in precond.layers},
    }
    # D7, uneven batch counts (last: it leaves the group broken): rank 0 has a third
    # batch, rank 1 stops after two and exits.
    model2 = _model()
    precond2 = KFACPreconditioner(model2)
    for step in range(3 if rank == 0 else 2):
        model2.zero_grad()
        inputs, targets = _batch(rank, step)
        F.cross_entropy(model2(inputs), targets).backward()
        started = time.monotonic()
        try:
            precond2.step()
        except RuntimeError as error:
            out["uneven"] = (step, time.monotonic() - started, str(error))
            return out
    out["uneven"] = None
    return out


@pytest.fixture(scope="module")
def plain_runs() -> list[dict[str, object]]:
    """The cases DETAIL cannot run (DDP, see the module docstring; pipelined unused layer)."""
    return run_distributed(_plain_worker, 2, timeout=120, collective_timeout=10)


def _assert_same(ours: object, theirs: object, label: str) -> None:
    """Bitwise equality of nested dicts/tuples/lists of tensors."""
    if isinstance(ours, Tensor) or isinstance(theirs, Tensor):
        assert isinstance(ours, Tensor) and isinstance(theirs, Tensor), label
        assert torch.equal(ours, theirs), label
    elif isinstance(ours, dict):
        assert isinstance(theirs, dict) and ours.keys() == theirs.keys(), label
        for key in ours:
            _assert_same(ours[key], theirs[key], f"{label}/{key}")
    elif isinstance(ours, (list, tuple)):
        assert isinstance(theirs, (list, tuple)) and len(ours) == len(theirs), label
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same(a, b, f"{label}[{index}]")
    else:
        assert ours == theirs, label


def test_d1_collectives_agree_under_detail(detail_runs: list[dict[str, object]]) -> None:
    # The run above completed: no "Collectives differ" on any rank, every strategy,
    # co-prime intervals, accumulation on, STEPS steps.
    assert all(out["detail"] for out in detail_runs)
    for strategy, variant in _detail_cases():
        key = f"{strategy}/{variant}"
        logs = [out[key]["log"] for out in detail_runs]  # type: ignore[index]
        assert logs[0] == logs[1], key
        assert len(logs[0]) > STEPS, key
        _assert_same(detail_runs[0][key]["params"], detail_runs[1][key]["params"], key)  # type: ignore[index]


class _SkipOnce(RecordingCommunicator):
    """Drops the next all-reduce once ``skip_next`` is set: the bug D1 must catch."""

    skip_next = False

    def all_reduce_sum(self, tensor: Tensor) -> Future[Tensor]:
        if self.skip_next:
            self.skip_next = False
            return completed(tensor)
        return super().all_reduce_sum(tensor)  # type: ignore[no-any-return]


def _skipped_collective_worker(rank: int, world_size: int) -> dict[str, object]:
    model = _model()
    # d-kfac exchanges its factors in step(), on the default group: buckets, then the
    # weights. At step 2, rank 1 drops its first bucket's all-reduce.
    communicator = _SkipOnce(TorchDistributedCommunicator())
    precond = KFACPreconditioner(model, strategy="d-kfac", process_group=communicator)
    for step in range(6):
        model.zero_grad()
        inputs, targets = _batch(rank, step)
        F.cross_entropy(model(inputs), targets).backward()
        communicator.skip_next = rank == 1 and step == 2
        try:
            precond.step()
        except RuntimeError as error:
            return {"step": step, "error": str(error)}
    return {"step": None, "error": None}


def test_d1_a_skipped_collective_is_caught_not_hung() -> None:
    results = run_distributed(
        _skipped_collective_worker, 2, timeout=60, collective_timeout=10, env=DETAIL
    )
    # Every rank raises at the step where rank 1 skipped, instead of hanging or mixing a
    # bucket of factors with the weights vector.
    for result in results:
        assert result["step"] == 2, results
    assert any("Collectives differ" in str(r["error"]) for r in results), results


def test_d3_hook_order_does_not_change_collectives_or_results(
    detail_runs: list[dict[str, object]],
) -> None:
    for strategy in STRATEGIES:
        ordered = [out[f"{strategy}/hook-order"] for out in detail_runs]
        plain = detail_runs[0][f"{strategy}/plain"]
        # The ranks really ran the branches in different orders...
        assert ordered[0]["factors"].keys() == ordered[1]["factors"].keys()  # type: ignore[index]
        assert list(ordered[0]["factors"]) != list(ordered[1]["factors"])  # type: ignore[index]
        # ...yet issued identical collectives and hold identical factors and parameters.
        assert ordered[0]["log"] == ordered[1]["log"], strategy  # type: ignore[index]
        if (
            strategy != "spd-kfac"
        ):  # spd-kfac's buckets follow measured times: not the same run to run
            assert ordered[0]["log"] == plain["log"], strategy  # type: ignore[index]
        for part in ("factors", "inverses", "params"):
            _assert_same(ordered[0][part], ordered[1][part], f"{strategy} {part}")  # type: ignore[index]
        for name, value in plain["params"].items():  # type: ignore[index]
            torch.testing.assert_close(ordered[0]["params"][name], value, rtol=1e-10, atol=1e-12)  # type: ignore[index]


def test_d4_layer_unused_on_one_rank_is_masked(
    detail_runs: list[dict[str, object]], plain_runs: list[dict[str, object]]
) -> None:
    # No hang (the runs completed); the unused rank's contribution is masked by the
    # all-reduced example weights (a weight of 0), so every rank holds the same factors.
    for strategy in STRATEGIES:
        source = plain_runs if strategy == "spd-kfac" else detail_runs
        runs = [out[f"{strategy}/unused"] for out in source]
        assert runs[0]["log"] == runs[1]["log"], strategy  # type: ignore[index]
        for part in ("factors", "inverses", "params", "side"):
            _assert_same(runs[0][part], runs[1][part], f"{strategy} {part}")  # type: ignore[index]
        side = runs[0]["side"]
        # Unused on every rank at a factor step: the factor is left as it was.
        assert torch.equal(side[UNUSED_EVERYWHERE], side[UNUSED_EVERYWHERE - 1])  # type: ignore[index]
        assert not torch.equal(side[UNUSED_EVERYWHERE - 2], side[UNUSED_EVERYWHERE - 3])  # type: ignore[index]
        for factor in runs[0]["factors"]["side"]:  # type: ignore[index]
            assert factor is not None and torch.isfinite(factor).all()
    # Under DDP with find_unused_parameters the replicas stay bit-identical.
    _assert_same(plain_runs[0]["ddp"], plain_runs[1]["ddp"], "ddp")


def test_d6_eval_and_no_grad_forwards_on_one_rank_change_nothing(
    detail_runs: list[dict[str, object]],
) -> None:
    for strategy in STRATEGIES:
        for rank, out in enumerate(detail_runs):
            with_eval, plain = out[f"{strategy}/eval-forwards"], out[f"{strategy}/plain"]
            label = f"{strategy} rank {rank}"
            # Bitwise equal to the run without them: factors, inverses, parameters,
            # counters and (spd-kfac's buckets follow measured times) the collectives.
            parts = ["factors", "inverses", "params", "counters"]
            for part in parts + ([] if strategy == "spd-kfac" else ["log"]):
                _assert_same(with_eval[part], plain[part], f"{label} {part}")  # type: ignore[index]
        quiet = detail_runs[0][f"{strategy}/eval-forwards"]["quiet"]  # type: ignore[index]
        assert len(quiet) == STEPS * (2 * ACCUMULATION + 2) and set(quiet) == {0}


def _concatenated_reference(strategy: str) -> dict[str, object]:
    """Single-process K-FAC on both ranks' batches, concatenated step by step."""
    model = _model()
    # Factors every step, so the smaller batches reach them.
    options = {**_options(strategy), "factor_update_steps": 1}
    precond = KFACPreconditioner(model, **options)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = [_last_batch_shards(0), _last_batch_shards(1)]
    for _epoch in range(2):
        for (inputs0, targets0), (inputs1, targets1) in zip(*shards, strict=True):
            optimizer.zero_grad()
            inputs, targets = torch.cat([inputs0, inputs1]), torch.cat([targets0, targets1])
            F.cross_entropy(model(inputs), targets).backward()
            assert precond.step()
            optimizer.step()
    return {
        "factors": {name: precond.factors(name) for name in precond.layers},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def test_d7_smaller_last_batch_is_weighted_by_its_examples(
    detail_runs: list[dict[str, object]],
) -> None:
    for strategy in STRATEGIES:
        reference = _concatenated_reference(strategy)
        for rank, out in enumerate(detail_runs):
            run = out[f"{strategy}/last-batch"]
            label = f"{strategy} rank {rank}"
            _assert_same(run, detail_runs[0][f"{strategy}/last-batch"], label)
            for name, pair in reference["factors"].items():  # type: ignore[attr-defined]
                for ours, expected in zip(run["factors"][name], pair, strict=True):  # type: ignore[index]
                    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12, msg=label)
            for name, expected in reference["params"].items():  # type: ignore[attr-defined]
                torch.testing.assert_close(
                    run["params"][name],
                    expected,
                    rtol=1e-10,
                    atol=1e-12,
                    msg=label,  # type: ignore[index]
                )


def test_d7_uneven_batch_counts_raise_instead_of_hanging(
    plain_runs: list[dict[str, object]],
) -> None:
    # The rank with the extra batch fails in its K-FAC collective within the process
    # group's timeout (10 s here) once its peer is gone: an error, never a hang. (The
    # built-in trainer pads with DistributedSampler, so its batch counts are equal.)
    assert plain_runs[1]["uneven"] is None
    step, seconds, message = plain_runs[0]["uneven"]  # type: ignore[misc]
    assert step == 2 and seconds < 30, (seconds, message)

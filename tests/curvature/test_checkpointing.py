"""Activation checkpointing, reentrant or not, with a layer called both outside and inside
the checkpointed region, in either order and with the region ending in that layer: each
call is captured exactly once (issue 39, item 3), as without checkpointing and as the
explicit float64 K-FAC of every call."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kfac_reference import with_one
from spdkfac import KFACPreconditioner

BATCH = 5


class _Shared(nn.Module):
    """``fc`` called once outside a region and once inside it (``fc`` ends the region)."""

    def __init__(self, mode: str | None, inside_first: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.mode = mode  # None: no checkpointing; "reentrant" / "non-reentrant"
        self.inside_first = inside_first
        self.calls: list[tuple[Tensor, Tensor]] = []  # (input, output) of fc, for the reference

    def _fc(self, x: Tensor) -> Tensor:
        out = self.fc(x)
        self.calls.append((x, out))
        return out

    def _region(self, x: Tensor) -> Tensor:
        return self._fc(torch.tanh(x) * 1.5)

    def _checkpointed(self, x: Tensor) -> Tensor:
        if self.mode is None:
            return self._region(x)
        out = checkpoint(self._region, x, use_reentrant=self.mode == "reentrant")
        assert isinstance(out, Tensor)
        return out

    def forward(self, x: Tensor) -> Tensor:
        if self.inside_first:
            # The reentrant kind needs an input that requires grad to reach fc's weight.
            h = self._fc(torch.tanh(self._checkpointed(x.requires_grad_(True))))
        else:
            h = self._checkpointed(torch.tanh(self._fc(x)))
        return self.head(torch.tanh(h))


def _model(mode: str | None, inside_first: bool) -> _Shared:
    torch.manual_seed(0)
    return _Shared(mode, inside_first).double()


def _data(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (
        torch.randn(BATCH, 4, generator=generator, dtype=torch.float64),
        torch.randint(0, 3, (BATCH,), generator=generator),
    )


def _run(mode: str | None, inside_first: bool) -> dict[str, Tensor]:
    model = _model(mode, inside_first)
    precond = KFACPreconditioner(model, kl_clip=None, factor_decay=0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for step in range(3):
            model.zero_grad()
            inputs, targets = _data(step)
            F.cross_entropy(model(inputs), targets).backward()
            assert precond.step()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name in precond.layers:
        a_factor, g_factor = precond.factors(name)
        assert a_factor is not None and g_factor is not None
        out[f"{name}.A"], out[f"{name}.G"] = a_factor, g_factor
    return out


def _explicit_fc_factors(inside_first: bool) -> tuple[Tensor, Tensor]:
    """fc's A and G at one step, from each of its two calls' inputs and output gradients
    (no checkpointing, no spdkfac): A = Σ_calls ā ā ᵀ / Σ B, G = Σ_calls δᵀδ / Σ B."""
    model = _model(None, inside_first)
    inputs, targets = _data(0)
    loss = F.cross_entropy(model(inputs), targets)
    outputs = [out for _, out in model.calls]
    grads = torch.autograd.grad(loss, outputs)
    assert len(model.calls) == 2
    a_total = sum(with_one_rows(x).T @ with_one_rows(x) for x, _ in model.calls)
    g_total = sum((BATCH * g).T @ (BATCH * g) for g in grads)
    return a_total / (2 * BATCH), g_total / (2 * BATCH)  # type: ignore[operator]


def with_one_rows(x: Tensor) -> Tensor:
    return torch.stack([with_one(row.detach()) for row in x])


@pytest.mark.parametrize("inside_first", [False, True], ids=["outside-first", "inside-first"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_each_call_is_captured_once_under_checkpointing(mode: str, inside_first: bool) -> None:
    expected = _run(None, inside_first)
    got = _run(mode, inside_first)
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-13, msg=key)


@pytest.mark.parametrize("inside_first", [False, True], ids=["outside-first", "inside-first"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointed_factors_match_the_explicit_reference(mode: str, inside_first: bool) -> None:
    model = _model(mode, inside_first)
    precond = KFACPreconditioner(model, kl_clip=None)
    inputs, targets = _data(0)
    F.cross_entropy(model(inputs), targets).backward()
    assert precond.step()
    a_expected, g_expected = _explicit_fc_factors(inside_first)
    a_factor, g_factor = precond.factors("fc")
    torch.testing.assert_close(a_factor, a_expected, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(g_factor, g_expected, rtol=1e-10, atol=1e-13)


def test_recomputations_leave_nothing_behind_between_factor_steps() -> None:
    """Non-reentrant regions stop recomputing early (torch's default): steps without a
    factor update must not pile up bookkeeping for those calls."""
    model = _model("non-reentrant", inside_first=False)
    precond = KFACPreconditioner(model, kl_clip=None, factor_update_steps=100)
    for step in range(5):
        model.zero_grad()
        inputs, targets = _data(step)
        F.cross_entropy(model(inputs), targets).backward()
        precond.step()
    capture = precond._stages.collector._capture  # the hooks' bookkeeping, per layer
    assert all(not calls for calls in capture._active.values())

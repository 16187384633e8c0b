"""A state dict saved with one inverse form (or grafting) loads into a preconditioner of
any other: the factors carry over, inverses of another kind are recomputed, a form's
running state the state dict does not hold (Adam's moments) starts fresh (and saves as
zeros with step count 0) — never a
``KeyError``; the next steps equal a preconditioner given the same factors."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner

#: (inverse_method, grafting): every form, stateful ones with and without Adam grafting.
FORMS = (
    ("cholesky", None),
    ("eigen", None),
    ("eigen-basis", None),
    ("eigen-adam", None),
    ("one-sided", None),
    ("cholesky", "adam"),
    ("eigen-adam", "adam"),
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _precond(model: nn.Module, method: str, grafting: str | None) -> KFACPreconditioner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KFACPreconditioner(
            model, damping=0.1, kl_clip=None, lr=0.1, inverse_method=method,
            grafting=grafting, inv_update_steps=1,
        )  # fmt: skip


def _step(model: nn.Module, precond: KFACPreconditioner, seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (16,), generator=generator)
    model.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    assert precond.step()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("source", FORMS, ids=lambda form: "+".join(filter(None, form)))
def test_every_form_loads_every_others_state_dict(source: tuple[str, str | None]) -> None:
    """Into every form: the saved factors, the moments both forms keep, the rest fresh;
    the next step is finite and applied."""
    model = _model()
    saving = _precond(model, *source)
    for seed in range(2):
        _step(model, saving, seed)
    saved = saving.state_dict()
    for target in FORMS:
        twin = _model()
        twin.load_state_dict(model.state_dict())
        loaded = _precond(twin, *target)
        loaded.load_state_dict(saved)
        state = loaded.state_dict()
        for name in ("0", "2"):
            for key in ("a_factor", "g_factor"):
                want, got = saved["layers"][name][key], state["layers"][name][key]
                if want is not None and got is not None:
                    torch.testing.assert_close(got, want)
            for key in _moments(target):
                # Carried: the saved moments; fresh: saved as zeros with step count 0.
                carried = key in _moments(source)
                value = state["layers"][name][key]
                assert value is not None and bool(value.any()) == carried, (target, key)
        assert all(g.isfinite().all() for g in _step(twin, loaded, 3)), target


def _moments(form: tuple[str, str | None]) -> list[str]:
    own = ["exp_avg", "exp_avg_sq", "steps"] if form[0] == "eigen-adam" else []
    return own + (["graft_exp_avg_sq", "graft_steps"] if form[1] == "adam" else [])


def test_loaded_then_stepped_equals_a_fresh_form_on_the_same_factors() -> None:
    """cholesky, eigen → eigen-adam (Adam grafted): the steps after loading equal those of a
    preconditioner of the target form given the same factors and no moments."""
    for source, target in itertools.product(FORMS[:2], FORMS[-1:]):
        model = _model()
        saving = _precond(model, *source)
        _step(model, saving, 0)
        saved = saving.state_dict()
        first, second = _model(), _model()
        first.load_state_dict(model.state_dict())
        second.load_state_dict(model.state_dict())
        loaded, fresh = _precond(first, *target), _precond(second, *target)
        loaded.load_state_dict(saved)
        fresh.load_state_dict(_factors_only(saved))
        for seed in (5, 6):
            after, again = _step(first, loaded, seed), _step(second, fresh, seed)
            for got, want in zip(after, again, strict=True):
                torch.testing.assert_close(got, want)


def _factors_only(saved: dict) -> dict:
    layers = {
        name: {"a_factor": e["a_factor"], "g_factor": e["g_factor"], "a_inverse": None,
               "g_inverse": None}
        for name, e in saved["layers"].items()
    }  # fmt: skip
    return {**saved, "layers": layers}


def test_a_missing_factor_entry_is_a_value_error_naming_it() -> None:
    model = _model()
    precond = _precond(model, "cholesky", None)
    _step(model, precond, 0)
    saved = precond.state_dict()
    del saved["layers"]["2"]["g_factor"]
    with pytest.raises(ValueError, match="layer '2' has no g_factor"):
        _precond(_model(), "cholesky", None).load_state_dict(saved)

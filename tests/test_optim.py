"""KFACOptimizer against the hand-written loop ``backward; precond.step(); opt.step()``."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from spdkfac import KFACOptimizer, KFACPreconditioner

OPTIONS = {"damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(
        8, 3, generator=g, dtype=torch.float64
    )


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return nn.functional.mse_loss(model(x), y)


def _base(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _by_hand(steps: int) -> tuple[nn.Module, KFACPreconditioner]:
    model = _model()
    opt = _base(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    precond = KFACPreconditioner(model, optimizer=opt, **OPTIONS)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        if precond.step():
            opt.step()
        sched.step()
    return model, precond


def _wrapped(steps: int, start: int = 0, opt: KFACOptimizer | None = None) -> KFACOptimizer:
    if opt is None:
        model = _model()
        opt = KFACOptimizer(model, _base(model), **OPTIONS)
    model = opt.preconditioner._model
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5, last_epoch=start - 1)
    for step in range(start, start + steps):
        opt.zero_grad()

        def closure(step: int = step) -> torch.Tensor:
            loss = _loss(model, step)
            loss.backward()
            return loss

        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor)
        sched.step()
    return opt


def _close(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_closure_and_scheduler_equal_hand_written_loop() -> None:
    model, precond = _by_hand(5)
    opt = _wrapped(5)
    _close(model, opt.preconditioner._model)
    assert opt.preconditioner.steps == precond.steps == 5
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25)
    assert opt.state is opt.optimizer.state
    assert "KFACOptimizer" in repr(opt)


@pytest.mark.parametrize("keyword", [False, True])
def test_state_dict_round_trip_into_fresh_instance(keyword: bool) -> None:
    model, _ = _by_hand(6)
    first = _wrapped(3)
    buffer = io.BytesIO()
    torch.save(
        {"model": first.preconditioner._model.state_dict(), "opt": first.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh_model = _model(seed=1)
    fresh_model.load_state_dict(saved["model"])
    fresh = KFACOptimizer(fresh_model, _base(fresh_model), **OPTIONS)
    if keyword:
        fresh.load_state_dict(state_dict=saved["opt"])
    else:
        fresh.load_state_dict(saved["opt"])
    assert fresh.param_groups is fresh.optimizer.param_groups
    _wrapped(3, start=3, opt=fresh)
    _close(model, fresh_model)


def test_bad_state_dict_refused() -> None:
    model = _model()
    opt = KFACOptimizer(model, _base(model), **OPTIONS)
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})


def test_non_finite_step_skips_base_optimizer() -> None:
    model = _model()
    opt = KFACOptimizer(model, _base(model), **OPTIONS)
    before = [p.detach().clone() for p in model.parameters()]
    (_loss(model, 0) * math.inf).backward()
    opt.step()
    assert opt.preconditioner.skipped_steps == 1
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert not opt.state


def test_lr_zero_init_step_changes_nothing() -> None:
    """torchtitan's optimizer-state init: zero gradients, lr 0, one step, lr restored."""
    fresh = _model()
    opt = KFACOptimizer(fresh, torch.optim.SGD(fresh.parameters(), lr=0.01), **OPTIONS)
    for p in fresh.parameters():
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.param_groups[0]["lr"] = 0.01
    assert opt.preconditioner.steps == 0
    assert all(f is None for f in opt.preconditioner.factors(opt.preconditioner.layers[0]))
    _close(_model(), fresh)
    # The next real steps are the hand-written loop's (SGD here: no state from the init step).
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    ref_pre = KFACPreconditioner(ref, optimizer=ref_opt, **OPTIONS)
    for step in range(3):
        for m, o, pre in ((ref, ref_opt, ref_pre), (fresh, opt, None)):
            o.zero_grad()
            _loss(m, step).backward()
            if pre is None or pre.step():
                o.step()
    _close(ref, fresh)


def test_closure_returning_nothing_still_steps() -> None:
    model = _model()
    opt = KFACOptimizer(model, _base(model), **OPTIONS)
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> None:
        _loss(model, 0).backward()

    assert opt.step(closure) is None
    assert opt.preconditioner.steps == 1
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_step_without_backward_is_the_preconditioners_error() -> None:
    model = _model()
    opt = KFACOptimizer(model, _base(model), **OPTIONS)
    _loss(model, 0).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="without a new backward pass"):
        opt.step()


def test_base_optimizer_missing_registered_parameters() -> None:
    model = _model()
    base = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'2'"):
        KFACOptimizer(model, base, **OPTIONS)
    # The refused wrapper released the model: another preconditioner may take it.
    KFACPreconditioner(model, **OPTIONS)


def test_add_param_group() -> None:
    model = nn.Sequential(_model(), nn.LayerNorm(3).double())
    base = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt = KFACOptimizer(model, base, **OPTIONS)
    with pytest.raises(ValueError, match="registered layers"):
        opt.add_param_group({"params": [model[0][0].weight]})
    opt.add_param_group({"params": model[1].parameters(), "lr": 0.5})
    assert opt.param_groups is base.param_groups and len(base.param_groups) == 2
    assert opt.param_groups[1]["lr"] == 0.5


def test_options_validated_like_the_preconditioner() -> None:
    model = _model()
    with pytest.raises(ValueError, match="damping"):
        KFACOptimizer(model, _base(model), damping=-1.0)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        KFACOptimizer(model, object())  # type: ignore[arg-type]


def test_grad_scaler_matches_unscaled_loop() -> None:
    ref = _model()
    ref_opt = _base(ref)
    ref_pre = KFACPreconditioner(ref, optimizer=ref_opt, **OPTIONS)
    scaled = _model()
    base = _base(scaled)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = KFACOptimizer(scaled, base, grad_scaler=scaler, **OPTIONS)
    for step in range(3):
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        if ref_pre.step():
            ref_opt.step()
        opt.zero_grad()
        scaler.scale(_loss(scaled, step)).backward()
        scaler.step(opt)
        scaler.update()
    torch.testing.assert_close(
        list(ref.parameters()), list(scaled.parameters()), rtol=1e-8, atol=1e-10
    )


def test_base_optimizer_missing_a_registered_bias() -> None:
    model = _model()
    held = [p for name, p in model.named_parameters() if name != "2.bias"]
    with pytest.raises(ValueError, match=r"registered layers \['2'\]"):
        KFACOptimizer(model, torch.optim.SGD(held, lr=0.1), **OPTIONS)


def test_dcp_optimizer_state_dict_round_trip() -> None:
    """DCP's functions carry the base optimizer's state; the preconditioner's travels
    beside it as ``dcp_state_dict()``."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, _ = _by_hand(6)
    first = _wrapped(3)
    saved = get_optimizer_state_dict(first.preconditioner._model, first)
    kfac = first.preconditioner.dcp_state_dict()
    fresh_model = _model(seed=1)
    fresh_model.load_state_dict(first.preconditioner._model.state_dict())
    fresh = KFACOptimizer(fresh_model, _base(fresh_model), **OPTIONS)
    set_optimizer_state_dict(fresh_model, fresh, saved)
    fresh.preconditioner.load_dcp_state_dict(kfac)
    _wrapped(3, start=3, opt=fresh)
    _close(model, fresh_model)


def _tiny_transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(10, 8),
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Linear(16, 8),
        nn.LayerNorm(8),
        nn.Linear(8, 10),
    ).double()


@pytest.mark.parametrize("recipe", ["kfac-muon", "kfac-eigen-adam", "kfac-eigen-adam-muon"])
def test_transformer_recipe_in_one_call_equals_cli_parts(recipe: str) -> None:
    from spdkfac.training.config import TrainConfig
    from spdkfac.training.setup import make_optimizers

    ref = _tiny_transformer()
    train = TrainConfig.from_dict(
        {"optimizer": recipe, "lr": 0.01, "weight_decay": 0.1, "inv_update_steps": 2}
    )
    _, ref_opt, ref_pre = make_optimizers(train, ref, steps_per_epoch=5)
    assert ref_pre is not None
    model = _tiny_transformer()
    opt = KFACOptimizer.transformer(model, recipe, lr=0.01, weight_decay=0.1, inv_update_steps=2)
    assert opt.preconditioner.layers == ["1", "3"]
    assert opt.preconditioner.config == ref_pre.config
    for step in range(3):
        tokens = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(step))
        for m, o, pre in ((ref, ref_opt, ref_pre), (model, opt, None)):
            o.zero_grad()
            m(tokens).logsumexp(-1).mean().backward()
            if pre is None or pre.step():
                o.step()
    torch.testing.assert_close(
        list(ref.parameters()), list(model.parameters()), rtol=1e-6, atol=1e-8
    )


def test_transformer_recipe_unknown_name_and_fixed_options_are_refused() -> None:
    with pytest.raises(ValueError, match="recipe must be one of"):
        KFACOptimizer.transformer(_tiny_transformer(), "kfac-sgd", lr=0.1)
    with pytest.raises(ValueError, match=r"kl_clip 0\.01 does not apply to recipe 'kfac-muon'"):
        KFACOptimizer.transformer(_tiny_transformer(), "kfac-muon", lr=0.1, kl_clip=0.01)


def test_transformer_recipe_defaults_to_eigen_adam_muon_with_its_weight_decay() -> None:
    opt = KFACOptimizer.transformer(_tiny_transformer(), lr=0.01)
    config = opt.preconditioner.config
    assert (config.inverse_method, config.factor_update_steps, config.inv_update_steps) == (
        "eigen-adam",
        2,
        2,
    )
    decays = sorted({group["weight_decay"] for group in opt.optimizer.param_groups})
    # The recipe's decay (0.01) on the matrices only (decay_scope "matrices").
    assert decays == [0.0, 0.01]
    assert {group.get("betas", (0.9, 0.95))[1] for group in opt.optimizer.param_groups} == {0.95}

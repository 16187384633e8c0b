"""``--optimizer kfac-eigen-adam-muon`` (eigen-Adam's direction, then Muon's
orthogonalization without momentum) and ``kfac-muon --inverse-method cholesky`` (two-sided
K-FAC, then Muon): the parameter split, the update against an explicit float64 computation, a state
dict across a refresh of the bases."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from spdkfac.layers import gradient_matrix
from spdkfac.models import build_model
from spdkfac.training.config import TrainConfig
from spdkfac.training.loop import cross_entropy_pass, train_step
from spdkfac.training.optimizers import CombinedOptimizer
from spdkfac.training.setup import make_optimizers
from test_forms_moments import explicit_adam, seen

__all__: list[str] = []

HIDDEN = [f"blocks.{b}.{layer}" for b in range(2)
          for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]  # fmt: skip
LR = 0.01


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16)
    return model.double()


def _setup(optimizer: str, model: nn.Module, **options: object):  # type: ignore[no-untyped-def]
    config = TrainConfig.from_dict(
        {"model": "gpt", "dataset": "text", "optimizer": optimizer, "lr": LR,
         "weight_decay": 0.0, **options}
    )  # fmt: skip
    _, combined, precond = make_optimizers(config, model, steps_per_epoch=5)
    assert precond is not None and isinstance(combined, CombinedOptimizer)
    return combined, precond


def _tokens(step: int) -> Tensor:
    return torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(step))


def newton_schulz(matrix: Tensor) -> Tensor:
    """Muon's quintic Newton–Schulz iteration (5 steps, its coefficients), in float64."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def test_parts_and_first_update_equal_the_explicit_float64_computation() -> None:
    """Muon (no momentum) takes the hidden weights, SGD without momentum their biases,
    AdamW the rest; each hidden weight moves by ``-lr·0.2·√max(m, n)·NS(V)`` with ``V``
    the explicit eigen-Adam step on the factors (float64; Muon iterates in bf16); the
    direction K-FAC hands Muon equals the explicit one to float64's rounding."""
    model = _gpt()
    combined, precond = _setup("kfac-eigen-adam-muon", model)
    assert precond.layers == HIDDEN and precond.config.inverse_method == "eigen-adam"
    assert set(combined.parts) == {"muon", "eigen-adam", "adamw"}
    muon = combined.parts["muon"]
    assert isinstance(muon, torch.optim.Muon) and muon.defaults["momentum"] == 0
    modules = dict(model.named_modules())
    before = {name: modules[name].weight.detach().clone() for name in HIDDEN}
    bias_before = {name: modules[name].bias.detach().clone() for name in HIDDEN}
    passes = [cross_entropy_pass(model, _tokens(0)[:, :-1], _tokens(0)[:, 1:])]
    raw: dict[str, Tensor] = {}

    def record() -> None:  # the raw gradients, before K-FAC writes its direction
        for name in HIDDEN:
            raw[name] = gradient_matrix(modules[name].weight.grad, modules[name].bias.grad)

    original = precond.step
    precond.step = lambda *args, **kwargs: (record(), original(*args, **kwargs))[1]  # type: ignore[method-assign]
    train_step(model, combined, precond, passes)
    for name in HIDDEN:
        a, g = precond.factors(name)
        assert a is not None and g is not None
        bases = [tuple(_basis(f) for f in (a, g))]
        direction = explicit_adam([raw[name]], bases)[0]  # type: ignore[arg-type]
        weight, bias = direction[:, :-1], direction[:, -1]
        fed = modules[name].weight.grad
        assert float((fed - weight).norm() / weight.norm()) < 1e-9, name
        scale = LR * 0.2 * max(weight.shape) ** 0.5
        moved = before[name] - modules[name].weight.detach()
        want = scale * newton_schulz(weight)
        # Muon iterates in bf16: 6-8 % from float64's iteration on these directions.
        error = float((moved - want).norm() / want.norm())
        assert error < 0.12, (name, error)
        torch.testing.assert_close(bias_before[name] - modules[name].bias.detach(), LR * bias)


def _basis(factor: Tensor) -> tuple[Tensor, Tensor]:
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)
    return eigenvectors, seen(eigenvalues)


def _run(optimizer: str, model: nn.Module, start: int, steps: int, state=None):  # type: ignore[no-untyped-def]
    combined, precond = _setup(optimizer, model, inv_update_steps=2, factor_update_steps=1)
    if state is not None:
        precond.load_state_dict(state[0])
        combined.load_state_dict(state[1])
    for step in range(start, start + steps):
        tokens = _tokens(step)
        train_step(
            model, combined, precond, [cross_entropy_pass(model, tokens[:, :-1], tokens[:, 1:])]
        )
    return precond, combined


def _step(model: nn.Module, combined: CombinedOptimizer, precond: object, step: int) -> None:
    tokens = _tokens(step)
    passes = [cross_entropy_pass(model, tokens[:, :-1], tokens[:, 1:])]
    train_step(model, combined, precond, passes)  # type: ignore[arg-type]


def test_state_dict_across_a_refresh_continues_as_the_uninterrupted_run() -> None:
    for optimizer in ("kfac-eigen-adam-muon",):  # (two-sided: kfac-muon's stateless path)
        model = _gpt()
        precond, combined = _run(optimizer, model, 0, 3)  # bases refreshed at 0 and 2
        state = copy.deepcopy((precond.state_dict(), combined.state_dict()))
        twin = _gpt()
        twin.load_state_dict(model.state_dict())
        for step in range(3, 5):  # the uninterrupted run goes on
            tokens = _tokens(step)
            train_step(
                model, combined, precond, [cross_entropy_pass(model, tokens[:, :-1], tokens[:, 1:])]
            )
        _run(optimizer, twin, 3, 2, state)
        for got, want in zip(twin.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(got, want, msg=optimizer)


def test_kfac_muon_two_sided_takes_the_hidden_layers_two_sided() -> None:
    model = _gpt()
    combined, precond = _setup("kfac-muon", model, inverse_method="cholesky")
    assert precond.layers == HIDDEN and precond.config.inverse_method == "cholesky"
    assert precond.config.kl_clip is None and set(combined.parts) == {"muon", "adamw"}

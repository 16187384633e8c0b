"""Base optimizers of ``spdkfac train``: Muon's parameter split, the combined optimizer,
SOAP from heavyball (and its error when missing), unknown names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from optional_helpers import break_packages
from spdkfac.cli import main
from spdkfac.models import build_model
from spdkfac.support.optional import OptionalPackageError, optional_import
from spdkfac.training.config import OPTIMIZERS, TrainConfig
from spdkfac.training.loop import cross_entropy_pass, train_step
from spdkfac.training.lr_schedules import apply_to_optimizer
from spdkfac.training.optimizers import (
    BASE_OPTIMIZERS,
    CombinedOptimizer,
    muon_parameters,
    require_base,
)
from spdkfac.training.setup import make_optimizers

__all__: list[str] = []


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return build_model("gpt", vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _names(model: nn.Module, parameters: list[nn.Parameter]) -> set[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)] for p in parameters}


def test_every_base_optimizer_has_a_builder() -> None:
    assert set(OPTIMIZERS.values()) == set(BASE_OPTIMIZERS)


def test_muon_takes_hidden_matrices_and_adamw_the_rest_of_a_gpt() -> None:
    model = _gpt()
    matrices, others = muon_parameters(model)
    hidden = {f"blocks.{b}.{layer}.weight" for b in range(2)
              for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}  # fmt: skip
    assert _names(model, matrices) == hidden
    rest = _names(model, others)
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"} <= rest
    assert "blocks.0.attn.qkv.bias" in rest and "blocks.1.ln1.weight" in rest
    # The tied head is the token embedding: counted once, and not Muon's.
    assert model.head.weight is model.tok_emb.weight
    assert len(matrices) + len(others) == len(list(model.parameters()))


def test_the_output_head_of_an_untied_model_is_adamws() -> None:
    model = _mlp()
    matrices, others = muon_parameters(model)
    assert _names(model, matrices) == {"0.weight", "2.weight"}
    assert _names(model, others) == {"0.bias", "2.bias", "4.weight", "4.bias"}


def test_muon_steps_scheduled_and_resumes_bit_identically() -> None:
    config = TrainConfig(model="mlp", optimizer="muon", lr=0.02, lr_schedule="cosine", epochs=2)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(5, 6, generator=generator), torch.randint(0, 3, (5,), generator=generator))
        for _ in range(6)
    ]

    def run(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            inputs, targets = batches[step]
            train_step(model, optimizer, None, [cross_entropy_pass(model, inputs, targets)])
            apply_to_optimizer(optimizer, step + 1, lr=lr_fn)

    straight = _mlp()
    lr_fn, optimizer, precond = make_optimizers(config, straight, steps_per_epoch=3)
    assert precond is None and isinstance(optimizer, CombinedOptimizer)
    assert set(optimizer.parts) == {"muon", "adamw"}
    assert isinstance(optimizer.parts["muon"], torch.optim.Muon)
    start = [p.detach().clone() for p in straight.parameters()]
    run(straight, optimizer, range(6))
    # The schedule reached every part through the shared parameter groups.
    assert {g["lr"] for g in optimizer.parts["muon"].param_groups} == {lr_fn(6)}
    assert {g["lr"] for g in optimizer.parts["adamw"].param_groups} == {lr_fn(6)}
    assert all(not torch.equal(p, s) for p, s in zip(straight.parameters(), start, strict=True))

    resumed = _mlp()
    _, first, _ = make_optimizers(config, resumed, steps_per_epoch=3)
    run(resumed, first, range(3))
    state = {k: v.clone() for k, v in resumed.state_dict().items()}
    saved = first.state_dict()
    again = _mlp()
    again.load_state_dict(state)
    _, second, _ = make_optimizers(config, again, steps_per_epoch=3)
    second.load_state_dict(saved)
    assert all(
        a is b
        for a, b in zip(
            second.param_groups,
            [*second.parts["muon"].param_groups, *second.parts["adamw"].param_groups],
            strict=True,
        )
    )
    run(again, second, range(3, 6))
    for mine, expected in zip(again.parameters(), straight.parameters(), strict=True):
        assert torch.equal(mine, expected)


def test_combined_optimizer_refuses_another_optimizers_state() -> None:
    model = _mlp()
    _, optimizer, _ = make_optimizers(TrainConfig(model="mlp", optimizer="muon"), model, 1)
    with pytest.raises(ValueError, match=r"saved optimizer parts \['adamw'\] are not"):
        optimizer.load_state_dict({"parts": {"adamw": {}}})
    with pytest.raises(ValueError, match="at least one optimizer"):
        CombinedOptimizer({})


def test_unknown_optimizer_is_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"optimizer must be one of .*'muon', 'soap'"):
        TrainConfig(optimizer="lion")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--optimizer", "lion"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'lion'" in capsys.readouterr().err


def test_soap_without_heavyball_names_the_option_and_the_pinned_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    break_packages(monkeypatch, tmp_path / "site", ["heavyball"], "ImportError")
    release = torch.__version__.partition("+")[0]
    with pytest.raises(OptionalPackageError, match="--optimizer soap needs the heavyball") as info:
        require_base("soap")
    assert isinstance(info.value, ValueError)
    assert f"pip install torch=={release} heavyball" in str(info.value)
    assert require_base("adamw") is None
    # The CLI refuses it before loading any data or starting a process group.
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--optimizer", "soap", "--model", "mlp", "--data", str(tmp_path / "no")])
    assert exit_info.value.code == 2
    assert "--optimizer soap needs the heavyball package" in capsys.readouterr().err


@pytest.mark.skipif(optional_import("heavyball") is None, reason="heavyball is not installed")
def test_soap_trains_a_small_model() -> None:
    model = _mlp()
    config = TrainConfig(model="mlp", optimizer="soap", lr=0.01, lr_schedule="constant")
    lr_fn, optimizer, precond = make_optimizers(config, model, steps_per_epoch=1)
    assert precond is None and type(optimizer).__name__ == "SOAP"
    generator = torch.Generator().manual_seed(2)
    inputs, targets = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,))
    losses = []
    for step in range(8):
        outcome = train_step(model, optimizer, None, [cross_entropy_pass(model, inputs, targets)])
        apply_to_optimizer(optimizer, step + 1, lr=lr_fn)
        losses.append(outcome.mean_loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]


def test_muon_on_a_torch_without_it_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    assert require_base("muon") is torch
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ValueError, match=r"--optimizer muon needs torch\.optim\.Muon"):
        require_base("muon")
    with pytest.raises(ValueError, match=r"--optimizer muon needs torch\.optim\.Muon"):
        make_optimizers(TrainConfig(model="mlp", optimizer="muon"), _mlp(), 1)


@pytest.mark.parametrize(
    ("optimizer", "form", "part"),
    [("kfac-muon", "one-sided", "muon"), ("kfac-eigen-adam", "eigen-adam", "eigen-adam")],
)
def test_transformer_recipe_takes_the_hidden_layers_with_its_form(
    optimizer: str, form: str, part: str
) -> None:
    """K-FAC preconditions the hidden Linear layers only (not the embeddings, the tied
    head, the norms), in the recipe's form, without the KL clip; the hidden matrices'
    part of the optimizer is Muon, or for eigen-adam a momentum-free SGD taking the
    form's direction as it is (weights and biases); AdamW the rest; one step trains."""
    model = _gpt()
    config = TrainConfig.from_dict(
        {"model": "gpt", "dataset": "text", "optimizer": optimizer, "lr": 0.003}
    )
    _, combined, precond = make_optimizers(config, model, steps_per_epoch=5)
    assert precond is not None and isinstance(combined, CombinedOptimizer)
    hidden = [f"blocks.{b}.{layer}" for b in range(2)
              for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]  # fmt: skip
    assert precond.layers == hidden
    assert precond.config.inverse_method == form and precond.config.kl_clip is None
    assert set(combined.parts) == {part, "adamw"}
    taken = _names(model, [p for g in combined.parts[part].param_groups for p in g["params"]])
    if part == "eigen-adam":
        sgd = combined.parts[part]
        assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0
        assert taken == {f"{name}.{kind}" for name in hidden for kind in ("weight", "bias")}
    else:
        assert taken == {f"{name}.weight" for name in hidden}
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(2))
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, combined, precond, [cross_entropy_pass(model, tokens[:, :-1], tokens[:, 1:])])
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))

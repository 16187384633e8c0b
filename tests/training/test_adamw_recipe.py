"""The baselines' usual recipe in ``spdkfac train``: AdamW's ``--beta2`` and gradient
clipping by global norm (``--grad-clip``)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from spdkfac.cli import main
from spdkfac.models import build_model
from spdkfac.training.config import TrainConfig
from spdkfac.training.loop import clip_gradients, cross_entropy_pass, train_step
from spdkfac.training.setup import make_optimizers

__all__: list[str] = []


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=generator) * 5, torch.randint(3, (16,), generator=generator)


def _adamw_betas(optimizer: torch.optim.Optimizer) -> set[tuple[float, float]]:
    return {tuple(group["betas"]) for group in optimizer.param_groups if "betas" in group}


@pytest.mark.parametrize("optimizer", ["adamw", "kfac-adamw", "muon"])
def test_beta2_reaches_every_adamw_part(optimizer: str) -> None:
    for beta2 in (0.95, 0.999):  # 0.999: the default, torch's
        torch.manual_seed(0)
        model = build_model("gpt", vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
        config = TrainConfig(model="gpt", dataset="text", optimizer=optimizer, beta2=beta2)
        _, built, _ = make_optimizers(config, model, steps_per_epoch=10)
        assert _adamw_betas(built) == {(0.9, beta2)}
        if optimizer == "muon":  # its AdamW part: embeddings, norms, biases
            parts = built.parts.values()  # type: ignore[attr-defined]
            assert {type(part).__name__ for part in parts} == {"Muon", "AdamW"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"beta2": 1.0}, "beta2 must be a finite number >= 0 and < 1, got 1.0"),
        ({"beta2": -0.1}, "beta2 must be a finite number >= 0 and < 1, got -0.1"),
        ({"grad_clip": -1.0}, "grad_clip must be a finite number >= 0, got -1.0"),
        ({"grad_clip": math.inf}, "grad_clip must be a finite number >= 0, got inf"),
        ({"optimizer": "sgd", "beta2": 0.95},
         "beta2 0.95 does not apply to optimizer 'sgd': it has no AdamW part"),
        ({"optimizer": "soap", "beta2": 0.99},
         r"beta2 0.99 does not apply to optimizer 'soap': SOAP keeps heavyball's betas"),
        ({"optimizer": "kfac", "strategy": "osawa", "grad_clip": 1.0},
         "grad_clip 1.0 needs the whole averaged gradient.*'osawa'"),
        ({"optimizer": "kfac", "strategy": "auto", "grad_clip": 1.0},
         "grad_clip 1.0 needs.*strategy 'auto' may run 'osawa'"),
        ({"fsdp": True, "grad_clip": 0.5}, "grad_clip 0.5 is not supported with fsdp"),
    ],
)  # fmt: skip
def test_bad_recipe_options_name_themselves(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict({"model": "mlp", **options})


def test_clipping_equals_torchs_clip_grad_norm() -> None:
    inputs, labels = _batch()
    ours, reference = _mlp(), _mlp()
    for model in (ours, reference):
        nn.functional.cross_entropy(model(inputs), labels).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    norm = clip_gradients(ours.parameters(), 0.1)
    assert float(norm) == pytest.approx(float(expected)) and float(norm) > 0.1
    for mine, theirs in zip(ours.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad)
    clipped = math.sqrt(sum(float(p.grad.square().sum()) for p in ours.parameters()))  # type: ignore[union-attr]
    assert clipped == pytest.approx(0.1, rel=1e-4)
    # A norm under the bound changes nothing.
    before = [p.grad.clone() for p in ours.parameters()]  # type: ignore[union-attr]
    clip_gradients(ours.parameters(), 10.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters(), strict=True))


def test_a_non_finite_norm_leaves_the_gradients_as_they_are() -> None:
    model = _mlp()
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    first = next(model.parameters())
    assert first.grad is not None
    first.grad[0, 0] = math.inf
    assert math.isinf(float(clip_gradients(model.parameters(), 1.0)))
    rest = [p.grad for p in list(model.parameters())[1:]]
    assert all(g is not None and bool((g == 1).all()) for g in rest)


def test_train_step_clips_before_the_update() -> None:
    inputs, labels = _batch()
    clipped, reference = _mlp(), _mlp()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (clipped, reference)]
    train_step(clipped, optimizers[0], None, [cross_entropy_pass(clipped, inputs, labels)],
               grad_clip=0.05)  # fmt: skip
    reference_loss = cross_entropy_pass(reference, inputs, labels)
    optimizers[1].zero_grad()
    reference_loss().backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    optimizers[1].step()
    for mine, theirs in zip(clipped.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
    unclipped = copy.deepcopy(_mlp())
    sgd = torch.optim.SGD(unclipped.parameters(), lr=0.5)
    train_step(unclipped, sgd, None, [cross_entropy_pass(unclipped, inputs, labels)])
    assert not torch.allclose(next(unclipped.parameters()), next(clipped.parameters()))


def test_the_flags_reach_the_run(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 80)
    out = tmp_path / "run"
    code = main(["train", "--model", "gpt", "--dataset", "text", "--data", str(text),
                 "--seq-len", "16", "--gpt-layers", "1", "--gpt-heads", "2", "--gpt-dim", "16",
                 "--batch-size", "4", "--threads", "1", "--no-tensorboard", "--optimizer",
                 "adamw", "--beta2", "0.95", "--grad-clip", "1", "--max-steps", "2",
                 "--out-dir", str(out)])  # fmt: skip
    assert code == 0
    written = (out / "config.toml").read_text()
    assert "beta2 = 0.95" in written and "grad_clip = 1.0" in written


def _decay_by_parameter(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    return {
        id(parameter): float(group["weight_decay"])
        for group in optimizer.param_groups
        for parameter in group["params"]
    }


@pytest.mark.parametrize(
    "optimizer", ["sgd", "adamw", "kfac-adamw", "muon", "kfac-muon", "kfac-eigen-adam", "soap"]
)
def test_decay_scope_matrices_spares_norms_biases_and_embeddings(optimizer: str) -> None:
    if optimizer == "soap":
        pytest.importorskip("heavyball")
    decays = {}
    for scope in ("all", "matrices"):
        torch.manual_seed(0)
        model = build_model("gpt", vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
        config = TrainConfig.from_dict(  # the optimizer's own defaults, as the CLI's
            {"model": "gpt", "dataset": "text", "optimizer": optimizer, "weight_decay": 0.1,
             "decay_scope": scope}
        )  # fmt: skip
        _, built, _ = make_optimizers(config, model, steps_per_epoch=10)
        named = dict(model.named_parameters())  # the tied head comes once, as the embedding
        decays[scope] = {name: _decay_by_parameter(built)[id(p)] for name, p in named.items()}
    assert set(decays["all"].values()) == {0.1}
    spared = {name for name, decay in decays["matrices"].items() if decay == 0.0}
    decayed = {name for name, decay in decays["matrices"].items() if decay == 0.1}
    assert spared == {
        name for name, p in named.items() if p.ndim == 1 or name.endswith("emb.weight")
    }
    assert decayed == {
        name for name, p in named.items() if p.ndim == 2 and not name.endswith("emb.weight")
    }
    assert "blocks.0.mlp.fc.weight" in decayed and "tok_emb.weight" in spared


def test_precondition_frequency_reaches_soap_and_only_soap() -> None:
    heavyball = pytest.importorskip("heavyball")
    model = build_model("gpt", vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
    for frequency, expected in ((None, 2), (10, 10)):
        config = TrainConfig(
            model="gpt", dataset="text", optimizer="soap", precondition_frequency=frequency
        )
        _, built, _ = make_optimizers(config, model, steps_per_epoch=10)
        assert isinstance(built, heavyball.SOAP)
        # heavyball keeps the interval as its reciprocal.
        assert 1 / built.precond_schedule == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"precondition_frequency 10 .*'muon': it is not SOAP"):
        TrainConfig(model="gpt", dataset="text", optimizer="muon", precondition_frequency=10)
    with pytest.raises(ValueError, match="decay_scope"):
        TrainConfig(decay_scope="biases")

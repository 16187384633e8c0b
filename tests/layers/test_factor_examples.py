"""``FactorOptions(examples=k)``: factors from the first k examples of each call only.

They equal those of a run that sees only those k examples (float64), while the gradient
keeps the whole batch; ``spdkfac train`` passes ``--factor-examples`` and
``--weight-sharing`` through.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spdkfac import KFACPreconditioner
from spdkfac.layers import FactorOptions
from spdkfac.training.config import TrainConfig
from spdkfac.training.setup import make_optimizers
from tiny_models import conv_net

BATCH, KEPT = 10, 4


def _sequence_net() -> nn.Module:
    """Linear layers over sequences of 3 positions with a LayerNorm between them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()


#: (model, input shape of one example, options): a convolution and Linear layers; Linear
#: layers shared over positions with a LayerNorm given curvature.
CASES = {
    "conv": (conv_net, (2, 4, 4), {}),
    "sequence": (_sequence_net, (3, 6), {"normalization": "diagonal"}),
}


def _factors(case: str, examples: int | None, inputs: torch.Tensor) -> dict:
    build, _, options = CASES[case]
    model = build()
    precond = KFACPreconditioner(
        model,
        damping=0.05,
        kl_clip=None,
        factor_options=FactorOptions(examples=examples),
        **options,  # type: ignore[arg-type]
    )
    model.zero_grad()
    logits = model(inputs).reshape(-1, 3)
    targets = torch.arange(logits.shape[0]) % 3
    F.cross_entropy(logits, targets).backward()  # the mean over this batch
    assert precond.step()
    factors = {name: precond.factors(name) for name in precond.layers}
    norms = {name: (precond.batchnorm_blocks(name)[0],) for name in precond.batchnorm_layers}
    assert len(norms) == len(options)  # the sequence case's LayerNorm has curvature
    return factors | norms


@pytest.mark.parametrize("case", CASES)
def test_factors_from_the_first_examples_equal_a_run_on_those_examples_alone(case: str) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(BATCH, *CASES[case][1], generator=generator, dtype=torch.float64)
    subsampled = _factors(case, KEPT, inputs)
    alone = _factors(case, None, inputs[:KEPT])
    whole = _factors(case, None, inputs)
    for name, factors in subsampled.items():
        for mine, theirs in zip(factors, alone[name], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(factors[-1], whole[name][-1])  # it did leave examples out
    # More examples than the batch holds: the whole batch.
    for name, factors in _factors(case, BATCH + 5, inputs).items():
        for mine, full in zip(factors, whole[name], strict=True):
            torch.testing.assert_close(mine, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("examples", [0, -1, 2.5, True])
def test_invalid_examples_are_refused(examples: object) -> None:
    with pytest.raises(ValueError, match="examples"):
        FactorOptions(examples=examples)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="factor_examples"):
        TrainConfig.from_dict({"factor_examples": examples})


def test_train_passes_the_factor_cost_options_to_the_preconditioner() -> None:
    config = TrainConfig.from_dict(
        {"model": "mlp", "optimizer": "kfac", "weight_sharing": "reduce", "factor_examples": 8}
    )
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    _, _, precond = make_optimizers(config, model, steps_per_epoch=3)
    assert precond is not None
    assert precond.config.weight_sharing == "reduce"
    assert precond.config.factor_options.examples == 8
    with pytest.raises(ValueError, match="weight_sharing"):
        TrainConfig.from_dict({"weight_sharing": "sum"})

"""K-FAC reaches a lower training loss than tuned SGD with momentum in the same steps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner

STEPS, BATCH = 60, 64
SGD_LEARNING_RATES = (0.01, 0.03, 0.1, 0.3)


def _mlp_data() -> tuple[Tensor, Tensor]:
    # Features on scales spanning 1.5 decades: the ill-conditioning K-FAC's A factor undoes.
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-1.5, 1, 20)
    inputs = torch.randn(512, 20, generator=generator) * scales
    teacher = torch.randn(20, 4, generator=generator) / scales[:, None] ** 0.5
    return inputs, (inputs @ teacher).argmax(1)


def _cnn_data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 1, 8, 8, generator=generator)
    inputs = inputs * torch.linspace(0.05, 3, 8).view(1, 1, 1, 8)
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 36, 4))
    for parameter in teacher.parameters():
        nn.init.normal_(parameter, std=1.0)
    with torch.no_grad():
        return inputs, teacher(inputs).argmax(1)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 4))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 64, 4),
    )


def _final_loss(
    make_model: Callable[[], nn.Module], data: tuple[Tensor, Tensor], lr: float, kfac: bool
) -> float:
    inputs, targets = data
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    precond = (
        KFACPreconditioner(model, lr=lr, damping=0.01, kl_clip=0.01, inv_update_steps=1)
        if kfac
        else None
    )
    for step in range(STEPS):
        start = (step * BATCH) % inputs.shape[0]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs[start : start + BATCH]), targets[start : start + BATCH])
        loss.backward()
        if precond is None or precond.step():
            optimizer.step()
    with torch.no_grad():
        return float(F.cross_entropy(model(inputs), targets))


@pytest.mark.parametrize(
    ("make_model", "make_data", "kfac_lr"),
    [(_mlp, _mlp_data, 0.03), (_cnn, _cnn_data, 0.03)],
    ids=["mlp", "cnn"],
)
def test_kfac_beats_the_best_sgd_learning_rate(
    make_model: Callable[[], nn.Module],
    make_data: Callable[[], tuple[Tensor, Tensor]],
    kfac_lr: float,
) -> None:
    torch.set_num_threads(1)
    data = make_data()
    best_sgd = min(_final_loss(make_model, data, lr, kfac=False) for lr in SGD_LEARNING_RATES)
    kfac = _final_loss(make_model, data, kfac_lr, kfac=True)
    # Measured: mlp 0.0059 vs 0.146, cnn 0.0001 vs 0.020 (K-FAC vs the best SGD rate).
    assert kfac < 0.25 * best_sgd, (kfac, best_sgd)

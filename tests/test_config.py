"""Invalid options raise ValueError naming the option and the value."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from spdkfac import KFACConfig, KFACPreconditioner


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("damping", 0.0),
        ("damping", -0.1),
        ("damping", float("nan")),
        ("damping", float("inf")),
        ("damping", "0.1"),
        ("factor_decay", 0.0),
        ("factor_decay", 1.5),
        ("factor_decay", float("nan")),
        ("factor_update_steps", 0),
        ("factor_update_steps", 1.5),
        ("factor_update_steps", True),
        ("inv_update_steps", -3),
        ("kl_clip", 0.0),
        ("kl_clip", float("nan")),
        ("lr", -1.0),
        ("lr", np.float32("nan")),
        ("lr", torch.tensor(float("inf"))),
        ("lr", torch.tensor([0.1])),
        ("damping", np.bool_(True)),
        ("damping", torch.tensor(True)),
        ("inv_update_steps", np.float32(2.0)),
        ("inverse_method", "lu"),
    ],
)
def test_invalid_option_names_option_and_value(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option) as info:
        KFACPreconditioner(_model(), **{option: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_valid_options_are_accepted() -> None:
    config = KFACConfig(damping=lambda s: 0.1, factor_decay=1.0, kl_clip=None, lr=0.0)
    assert config.damping_at(3) == 0.1 and config.lr_at(0) == 0.0


_ARRAY_SCALARS = {
    "lr": np.float32(0.05),
    "damping": torch.tensor(0.1),
    "kl_clip": np.float64(0.01),
    "factor_decay": np.array(0.9),
    "factor_update_steps": np.int64(1),
    "inv_update_steps": torch.tensor(2),
    "bucket_cap_mb": np.float32(1.0),
    "accumulation_steps": np.int32(1),
    "batchnorm_damping_multiplier": torch.tensor(2.0, dtype=torch.float64),
}


def _preconditioned_gradients(**options: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    precond = KFACPreconditioner(model, **options)  # type: ignore[arg-type]
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(8, 3)).square().sum().backward()
        assert precond.step()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_numpy_and_0d_tensor_scalars_are_numbers() -> None:
    """A numpy scalar or a 0-d tensor is a number: stored as a Python float (int), and the
    preconditioner computes exactly what the same values as Python numbers give."""
    config = KFACConfig(**_ARRAY_SCALARS)  # type: ignore[arg-type]
    for name, value in _ARRAY_SCALARS.items():
        stored = getattr(config, name)
        assert type(stored) is type(value.item()) and stored == value.item(), name
    plain = {name: value.item() for name, value in _ARRAY_SCALARS.items()}
    assert config == KFACConfig(**plain)
    ours = _preconditioned_gradients(**_ARRAY_SCALARS)
    theirs = _preconditioned_gradients(**plain)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_model_without_supported_layer() -> None:
    with pytest.raises(ValueError, match="no layer K-FAC supports"):
        KFACPreconditioner(nn.Sequential(nn.BatchNorm1d(3), nn.ReLU()))
    with pytest.raises(ValueError, match="no layer K-FAC supports"):
        KFACPreconditioner(nn.Sequential(nn.Linear(3, 3)), skip_layers=[nn.Linear])


def test_unsupported_layers_are_listed_once() -> None:
    model = nn.Sequential(
        nn.EmbeddingBag(5, 3),
        nn.Linear(3, 4),
        nn.BatchNorm1d(4),
        nn.BatchNorm1d(4),
        nn.Linear(4, 2),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KFACPreconditioner(model, lr=0.1)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1
    assert "BatchNorm1d (2)" in messages[0] and "EmbeddingBag (1)" in messages[0]


def test_skip_layers_by_name_and_type() -> None:
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Conv1d(1, 1, 1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = KFACPreconditioner(model, skip_layers=["1"])
        assert first.layers == ["0", "2"]
        first.remove()  # one preconditioner per model at a time
        second = KFACPreconditioner(model, skip_layers=["1.0", nn.Conv1d])
        assert second.layers == ["0", "1.1"]
        second.remove()
    with pytest.raises(ValueError, match="'nope' matches no module"):
        KFACPreconditioner(model, skip_layers=["nope"])
    with pytest.raises(ValueError, match="skip_layers"):
        KFACPreconditioner(model, skip_layers="1")


def test_frozen_layers_are_not_registered() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    assert KFACPreconditioner(model).layers == ["1"]


def test_linear_subclass_keeping_forward_is_supported() -> None:
    class Tagged(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precond = KFACPreconditioner(nn.Sequential(Tagged(3, 3), Custom(3, 3)))
    assert precond.layers == ["0"]
    assert "Custom (1)" in str(caught[0].message)


def test_arguments_after_model_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        KFACPreconditioner(_model(), 0.1)  # type: ignore[misc]

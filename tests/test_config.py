"""Invalid options raise ValueError naming the option and the value."""

from __future__ import annotations

import warnings

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

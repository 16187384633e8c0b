"""The transformer recipe as :meth:`spdkfac.KFACOptimizer.transformer` builds it: the base
optimizer and K-FAC options ``spdkfac train --optimizer kfac-muon|kfac-eigen-adam`` use."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from spdkfac.config import KFACConfig
from spdkfac.layout import layout_of
from spdkfac.training.config import OPTIMIZERS, TrainConfig
from spdkfac.training.kfac_options import (
    TRANSFORMER_RECIPES,
    recipe_defaults,
    transformer_recipe,
)
from spdkfac.training.optimizers import BASE_OPTIMIZERS, hidden_layers

__all__ = ["recipe_parts"]

_FIELDS = frozenset(field.name for field in dataclasses.fields(KFACConfig))


def recipe_parts(
    model: nn.Module, recipe: str, lr: float, weight_decay: float, options: Mapping[str, Any]
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """(the recipe's base optimizer over ``model``, the constructor's keyword options).

    Raises:
        ValueError: ``recipe`` is not one of :data:`TRANSFORMER_RECIPES`.
    """
    if recipe not in TRANSFORMER_RECIPES:
        raise ValueError(f"recipe must be one of {sorted(TRANSFORMER_RECIPES)}, got {recipe!r}")
    module = layout_of(model).module
    fields = {k: v for k, v in options.items() if k in _FIELDS}
    runtime = {k: v for k, v in options.items() if k not in _FIELDS}
    kfac = transformer_recipe(
        KFACConfig(**{**recipe_defaults(recipe), **fields}),
        recipe,
        set(hidden_layers(module)),
        module,
    )
    train = TrainConfig(optimizer=recipe, lr=lr, weight_decay=weight_decay, momentum=0.95)
    base = BASE_OPTIMIZERS[OPTIMIZERS[recipe]](train, module, lr)
    return base, {**runtime, "config": kfac}

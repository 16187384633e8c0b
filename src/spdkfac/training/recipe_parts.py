"""The transformer recipe as :meth:`spdkfac.KFACOptimizer.transformer` builds it: the base
optimizer and K-FAC options ``spdkfac train --optimizer kfac-muon`` (or another row of
:data:`~spdkfac.training.optimizer_table.OPTIMIZER_TABLE` that takes the hidden layers
only) uses, from the same table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from spdkfac.config import KFACConfig
from spdkfac.layout import layout_of
from spdkfac.training.config import TrainConfig
from spdkfac.training.kfac_options import hidden_layers_only
from spdkfac.training.optimizer_table import OPTIMIZER_TABLE
from spdkfac.training.optimizers import build_base_optimizer, hidden_layers

__all__ = ["RECIPES", "recipe_parts"]

#: The recipes: the ``--optimizer`` rows whose K-FAC takes the hidden layers only.
RECIPES: tuple[str, ...] = tuple(name for name, row in OPTIMIZER_TABLE.items() if row.hidden_only)
_FIELDS = frozenset(field.name for field in dataclasses.fields(KFACConfig))


def recipe_parts(
    model: nn.Module,
    recipe: str,
    lr: float,
    weight_decay: float | None,
    options: Mapping[str, Any],
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """(the recipe's base optimizer over ``model``, the constructor's keyword options);
    ``weight_decay`` None: the recipe's.

    Raises:
        ValueError: ``recipe`` is not one of :data:`RECIPES`, or an option the recipe fixes
            (the KL clip of a Muon recipe, say) is given.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}")
    fixes = OPTIMIZER_TABLE[recipe].fixes()
    for name, value in options.items():
        if name in fixes:
            raise ValueError(f"{name} {value!r} does not apply to recipe {recipe!r}: {fixes[name]}")
    module = layout_of(model).module
    fields = {k: v for k, v in options.items() if k in _FIELDS}
    runtime = {k: v for k, v in options.items() if k not in _FIELDS}
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    train = TrainConfig.from_dict({"optimizer": recipe, "lr": lr, **decay})
    kfac = dataclasses.replace(train.kfac, **fields)
    kfac = hidden_layers_only(kfac, set(hidden_layers(module)), module)
    return build_base_optimizer(train, module, lr), {**runtime, "config": kfac}

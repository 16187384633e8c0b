"""The ``torch.optim.Optimizer`` face of K-FAC, for trainers that own the training loop.

:class:`KFACOptimizer` holds a :class:`~spdkfac.KFACPreconditioner` and a base optimizer:
its :meth:`~KFACOptimizer.step` preconditions the gradients, then steps the base optimizer
(or skips it when the preconditioner reports a non-finite step). Trainers that call
``optimizer.step(closure)``, schedule ``param_groups[i]["lr"]``, clip gradients through the
optimizer or save ``optimizer.state_dict()`` see one ordinary optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from spdkfac.layout import layout_of
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.training.recipe_parts import recipe_parts

__all__ = ["KFACOptimizer"]


def _unheld(model: nn.Module, layers: list[str], optimizer: torch.optim.Optimizer) -> list[str]:
    """Registered layers (names in the user's module) with a parameter ``optimizer`` lacks."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    module = layout_of(model).module
    return [
        name
        for name in layers
        if any(id(p) not in held for p in module.get_submodule(name).parameters(recurse=False))
    ]


class KFACOptimizer(torch.optim.Optimizer):
    """K-FAC over ``model`` applied by ``optimizer``, as one ``torch.optim.Optimizer``.

    ``param_groups`` are the base optimizer's own dicts and ``state`` its state, so
    learning-rate schedulers, gradient clipping by a trainer and the KL clip all read and
    change the same values.

    Args:
        model: The model, plain, ``DistributedDataParallel`` or ``fully_shard``-ed; its
            registered layers' parameters must all be in ``optimizer``.
        optimizer: The base optimizer (SGD, AdamW, Muon, …) applying the update.
        **options: What :class:`~spdkfac.KFACPreconditioner` takes besides ``model`` and
            ``optimizer``: ``config``, ``process_group``, ``cost_model``, ``grad_scaler``,
            ``profile`` and the fields of :class:`~spdkfac.KFACConfig`, validated the same.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: An invalid option, or registered layers whose parameters ``optimizer``
            does not hold (named).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if "optimizer" in options:
            raise TypeError("give the base optimizer once, as the second argument")
        self.optimizer = optimizer
        self.preconditioner = KFACPreconditioner(model, optimizer=optimizer, **options)
        missing = _unheld(model, self.preconditioner.layers, optimizer)
        if missing:
            self.preconditioner.remove()
            raise ValueError(
                f"optimizer does not hold the parameters of the registered layers {missing}"
            )
        self._model = model
        self._ready = False
        # The base class's hooks and counters, over the base optimizer's own groups and
        # state (the properties below): its __init__ adds nothing here.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._ready = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's group dicts themselves."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if getattr(self, "_ready", False):
            self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The base optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        if getattr(self, "_ready", False):
            self.optimizer.state = state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure`` (forward and backward) if given, precondition, step.

        A step before the preconditioner's first, with every learning rate 0 (how
        torchtitan creates optimizer state), steps only the base optimizer: no factor,
        counter or gradient of the preconditioner changes.

        Returns:
            What ``closure`` returned (None without one).

        Raises:
            RuntimeError: No backward pass since the last step (the preconditioner's error).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.preconditioner.steps == 0 and all(g["lr"] == 0 for g in self.param_groups):
            self.optimizer.step()
            return loss
        if self.preconditioner.step():
            self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer (shared here too).

        Raises:
            ValueError: The group holds a parameter of a registered layer (those are all
                in the optimizer already: a second group would split or repeat them).
        """
        if not getattr(self, "_ready", False):  # the base class's __init__: groups exist
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        module = layout_of(self._model).module
        registered = {
            id(p): name
            for name in self.preconditioner.layers
            for p in module.get_submodule(name).parameters(recurse=False)
        }
        clash = sorted({registered[id(p)] for p in params if id(p) in registered})
        if clash:
            raise ValueError(f"param_group holds parameters of the registered layers {clash}")
        self.optimizer.add_param_group({**param_group, "params": params})

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict (``state``, ``param_groups``) with the
        preconditioner's nested under ``"preconditioner"``."""
        return {**self.optimizer.state_dict(), "preconditioner": self.preconditioner.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (also by keyword, as DCP calls it).

        ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` keeps only
        ``state`` and ``param_groups``: without ``"preconditioner"`` the preconditioner
        is left as it is (save its ``dcp_state_dict()`` beside the optimizer's).

        Raises:
            ValueError: ``state_dict`` lacks the base optimizer's ``state`` or
                ``param_groups``, or its preconditioner part does not match the layers.
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else state_dict
            raise ValueError(f"state_dict must hold 'state' and 'param_groups', got {keys}")
        base = {k: v for k, v in state_dict.items() if k != "preconditioner"}
        if "preconditioner" in state_dict:
            self.preconditioner.load_state_dict(state_dict["preconditioner"])
        self.optimizer.load_state_dict(base)

    @classmethod
    def transformer(
        cls,
        model: nn.Module,
        recipe: str = "kfac-eigen-adam-muon",
        *,
        lr: float,
        weight_decay: float | None = None,
        **options: Any,
    ) -> KFACOptimizer:
        """The transformer recipe of ``spdkfac train --optimizer <recipe>`` in one call.

        ``"kfac-eigen-adam-muon"`` (the default): Adam's moments in K-FAC's eigenbases on
        the hidden ``nn.Linear`` layers, then Muon's orthogonalization of their weight
        updates, AdamW the rest (embeddings, head, norms, biases): the K-FAC form with the
        fewest steps to the time-to-result study's text target. ``"kfac-muon"``: K-FAC
        (one-sided form, no KL clip) on the hidden layers, then Muon; ``"kfac-eigen-adam"``:
        the eigen-Adam form alone on the hidden layers. The recipe's defaults (weight
        decay, damping, update intervals, beta2) apply unless given; the learning rate,
        which depends on the model, is always given.

        Args:
            model: The model (hidden layers as ``spdkfac.training.optimizers.hidden_layers``
                finds them in the user's module).
            recipe: An ``spdkfac train --optimizer`` of the recipe: ``"kfac-eigen-adam-muon"``,
                ``"kfac-muon"`` or ``"kfac-eigen-adam"`` (its defaults, its fixed options
                refused).
            lr: The learning rate of every group.
            weight_decay: Decoupled weight decay of every group (None: the recipe's).
            **options: As for the constructor (``KFACConfig`` fields, ``process_group``, …).

        Raises:
            ValueError: An unknown ``recipe`` or an invalid option.
        """
        base, keywords = recipe_parts(model, recipe, lr, weight_decay, options)
        return cls(model, base, **keywords)

    def __repr__(self) -> str:
        return f"KFACOptimizer({self.preconditioner!r}, {self.optimizer!r})"

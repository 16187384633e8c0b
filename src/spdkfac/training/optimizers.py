"""The base optimizers of ``spdkfac train``, one builder per name, and how Muon splits a model.

:data:`BASE_OPTIMIZERS` maps each base of :data:`spdkfac.training.config.OPTIMIZERS` to a
builder ``(config, model, lr) -> Optimizer``. Muon follows the usual recipe:
``torch.optim.Muon`` on the hidden weight matrices (:func:`muon_parameters`), AdamW on
everything else, stepped, scheduled and checkpointed as one :class:`CombinedOptimizer`.
SOAP comes from the optional ``heavyball`` package; :func:`require_base` checks what a
base optimizer needs before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, overload

import torch
from torch import nn

from spdkfac.support.optional import OptionalPackageError, optional_import, unavailable_reason
from spdkfac.training.config import TrainConfig

__all__ = [
    "BASE_OPTIMIZERS",
    "BASE_REQUIREMENTS",
    "CombinedOptimizer",
    "OptimizerBuilder",
    "build_base_optimizer",
    "decay_groups",
    "hidden_layers",
    "muon_parameters",
    "require_base",
]

#: ``(config, model, initial lr) -> optimizer`` over the model's parameters.
OptimizerBuilder = Callable[[TrainConfig, nn.Module, float], torch.optim.Optimizer]


class CombinedOptimizer(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, stepped, scheduled and saved as one.

    ``param_groups`` are the parts' own group dicts, in order, so setting a group's ``lr``
    (the trainer's schedule, K-FAC's KL clip reading it) reaches the part that uses it.
    The state lives in the parts; :meth:`state_dict` nests theirs by name.

    Args:
        parts: Name -> optimizer; no parameter may appear in two parts.

    Raises:
        ValueError: ``parts`` is empty or shares a parameter between two parts.
    """

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer]) -> None:
        if not parts:
            raise ValueError("parts must hold at least one optimizer, got none")
        self.parts = dict(parts)
        groups = [group for part in self.parts.values() for group in part.param_groups]
        # The base class keeps these dicts themselves (and refuses a parameter in two).
        super().__init__(groups, {})

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step every part (``closure``, if given, is evaluated once, first)."""
        loss = None if closure is None else closure()
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """``{"parts": {name: part.state_dict()}}``."""
        return {"parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; the parts must have the same names.

        Raises:
            ValueError: The saved parts are not this optimizer's.
        """
        saved = state_dict.get("parts")
        if not isinstance(saved, Mapping) or set(saved) != set(self.parts):
            names = sorted(saved) if isinstance(saved, Mapping) else saved
            raise ValueError(f"saved optimizer parts {names} are not {sorted(self.parts)}")
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])
        # Loading gives each part new group dicts: share them again.
        self.param_groups = [group for part in self.parts.values() for group in part.param_groups]


def hidden_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The transformer recipe's hidden layers, by name in ``model``: every ``nn.Linear``
    with a 2-D weight but the last one in module order (the output head) and any whose
    weight an ``nn.Embedding`` also owns (a tied head). Muon and the K-FAC forms for
    transformers take these; embeddings, the head, norms and other shapes (convolution
    kernels) are AdamW's (Jordan et al.'s Muon recipe; Vyas et al. 2024 leave the same to
    Adam in SOAP's language-model runs)."""
    linears = [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    embedded = {
        id(parameter)
        for module in model.modules()
        if isinstance(module, nn.Embedding)
        for parameter in module.parameters()
    }
    return {
        name: layer
        for name, layer in linears[:-1]
        if layer.weight.ndim == 2 and id(layer.weight) not in embedded
    }


def _split(model: nn.Module, taken: set[int]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the parameters in ``taken`` by id, the others), each parameter once."""
    chosen: list[nn.Parameter] = []
    others: list[nn.Parameter] = []
    for parameter in model.parameters():  # tied parameters come once
        (chosen if id(parameter) in taken else others).append(parameter)
    return chosen, others


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's hidden weight matrices, AdamW's other parameters), each parameter once: the
    weights of :func:`hidden_layers`; their biases are AdamW's."""
    return _split(model, {id(layer.weight) for layer in hidden_layers(model).values()})


def _decayed_matrices(model: nn.Module) -> set[int]:
    """The ids of the weights of linear and convolution layers that no ``nn.Embedding``
    owns (a tied output head is the embedding's)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))
        and module.weight.ndim >= 2
        and id(module.weight) not in embedded
    }


def decay_groups(
    parameters: list[nn.Parameter], model: nn.Module, config: TrainConfig
) -> list[dict[str, Any]]:
    """``parameters`` as an optimizer's param groups under ``config.decay_scope``: one group
    for ``"all"``; for ``"matrices"``, the weights of linear and convolution layers, then
    the rest (norms, biases, embeddings, a tied head) with weight decay 0 — the usual
    language-model recipe (empty groups left out)."""
    if config.decay_scope == "all":
        return [{"params": parameters}]
    matrices = _decayed_matrices(model)
    decayed = [p for p in parameters if id(p) in matrices]
    kept = [p for p in parameters if id(p) not in matrices]
    groups: list[dict[str, Any]] = [{"params": decayed}] if decayed else []
    return groups + ([{"params": kept, "weight_decay": 0.0}] if kept else [])


def _sgd(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        decay_groups(list(model.parameters()), model, config),
        lr=lr,
        momentum=config.momentum,
        nesterov=config.nesterov,
        weight_decay=config.weight_decay,
    )


def _adamw(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        decay_groups(list(model.parameters()), model, config),
        lr=lr,
        weight_decay=config.weight_decay,
        betas=_betas(config),
    )


def _betas(config: TrainConfig) -> tuple[float, float]:
    """Every AdamW part's betas: torch's default beta1, the configured ``beta2``."""
    return 0.9, config.beta2


def _with_adamw(
    parts: dict[str, torch.optim.Optimizer],
    others: list[nn.Parameter],
    model: nn.Module,
    config: TrainConfig,
    lr: float,
) -> CombinedOptimizer:
    """``parts`` and AdamW over ``others`` (when there are any), as one optimizer."""
    if others:
        parts["adamw"] = torch.optim.AdamW(
            decay_groups(others, model, config),
            lr=lr,
            weight_decay=config.weight_decay,
            betas=_betas(config),
        )
    return CombinedOptimizer(parts)


def _muon(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    _torch_with_muon()
    matrices, others = muon_parameters(model)
    parts: dict[str, torch.optim.Optimizer] = {}
    if matrices:
        # Moonshot's scaling makes Muon's update RMS match AdamW's, so one lr schedule and
        # one weight decay serve both parts (the trainer sets one lr on every group).
        parts["muon"] = torch.optim.Muon(
            matrices,
            lr=lr,
            weight_decay=config.weight_decay,
            momentum=config.momentum,
            nesterov=config.nesterov,
            adjust_lr_fn="match_rms_adamw",
        )
    return _with_adamw(parts, others, model, config, lr)


def _eigen_adam(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """``--optimizer kfac-eigen-adam``'s base: the preconditioner's ``"eigen-adam"`` form
    is Adam in K-FAC's eigen-bases (momentum and scale included), so the hidden layers
    (weights and biases, one K-FAC block each) take its direction as it is: SGD without
    momentum, whose weight decay is then AdamW's decoupled decay. AdamW on the rest."""
    taken = {id(p) for layer in hidden_layers(model).values() for p in layer.parameters()}
    direct, others = _split(model, taken)
    parts: dict[str, torch.optim.Optimizer] = {}
    if direct:
        parts["eigen-adam"] = torch.optim.SGD(
            decay_groups(direct, model, config), lr=lr, weight_decay=config.weight_decay
        )
    return _with_adamw(parts, others, model, config, lr)


def _eigen_adam_muon(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """``--optimizer kfac-eigen-adam-muon``'s base: the ``"eigen-adam"`` direction (Adam in
    K-FAC's eigen-bases, momentum included) orthogonalized by Muon without momentum of its
    own on the hidden weight matrices — SOAP-style preconditioning before Newton–Schulz,
    the structure of modded-nanogpt's record — their biases taking the direction as it is
    (SGD without momentum); AdamW on the rest."""
    _torch_with_muon()
    hidden = hidden_layers(model).values()
    direct, others = _split(model, {id(p) for layer in hidden for p in layer.parameters()})
    weights = {id(layer.weight) for layer in hidden}
    matrices = [p for p in direct if id(p) in weights]
    biases = [p for p in direct if id(p) not in weights]
    parts: dict[str, torch.optim.Optimizer] = {}
    if matrices:
        parts["muon"] = torch.optim.Muon(
            matrices, lr=lr, weight_decay=config.weight_decay, momentum=0.0,
            nesterov=False, adjust_lr_fn="match_rms_adamw",
        )  # fmt: skip
    if biases:
        parts["eigen-adam"] = torch.optim.SGD(
            decay_groups(biases, model, config), lr=lr, weight_decay=config.weight_decay
        )
    return _with_adamw(parts, others, model, config, lr)


def _soap(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    heavyball = _heavyball()
    parameters = list(model.parameters())
    if all(parameter.device.type == "cpu" for parameter in parameters):
        # heavyball compiles its kernels by default: the first step took 388 s on this
        # project's 2-core CPU, longer than a whole run; eager it is a fraction of a second.
        heavyball.utils.compile_mode = None
    frequency = (
        {}
        if config.precondition_frequency is None
        else {"precondition_frequency": config.precondition_frequency}
    )
    optimizer = heavyball.SOAP(
        decay_groups(parameters, model, config),
        lr=lr,
        weight_decay=config.weight_decay,
        compile_step=False,
        **frequency,
    )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"heavyball.SOAP is not a torch.optim.Optimizer: {type(optimizer)}")
    return optimizer


#: The base optimizers of :data:`spdkfac.training.config.OPTIMIZERS`, by name.
BASE_OPTIMIZERS: dict[str, OptimizerBuilder] = {
    "sgd": _sgd,
    "adamw": _adamw,
    "muon": _muon,
    "soap": _soap,
    "eigen-adam": _eigen_adam,
    "eigen-adam-muon": _eigen_adam_muon,
}


def _heavyball() -> ModuleType:
    module = optional_import("heavyball")
    if module is None:
        release = torch.__version__.partition("+")[0]
        raise OptionalPackageError(
            f"--optimizer soap needs the heavyball package ({unavailable_reason('heavyball')}); "
            f"install it keeping torch pinned: pip install torch=={release} heavyball"
        )
    return module


def _torch_with_muon() -> ModuleType:
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(
            f"--optimizer muon needs torch.optim.Muon, which torch {torch.__version__} lacks; "
            "use a torch release that has it (this project pins torch==2.13.0)"
        )
    return torch


#: What a base optimizer needs beyond spdkfac's own requirements: name -> a check that
#: returns the module providing it or raises a ``ValueError`` saying how to get it.
BASE_REQUIREMENTS: dict[str, Callable[[], ModuleType]] = {
    "muon": _torch_with_muon,
    "soap": _heavyball,
}


def require_base(name: str) -> ModuleType | None:
    """The module base optimizer ``name`` needs beyond spdkfac's own requirements, or None.

    Raises:
        ValueError: It is missing (an :class:`~spdkfac.support.optional.OptionalPackageError` for a
            package); the message names ``--optimizer NAME`` and how to get it, for a
            package with the pip command that keeps torch pinned.
    """
    check = BASE_REQUIREMENTS.get(name)
    return None if check is None else check()


def build_base_optimizer(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The configured base optimizer over ``model``'s parameters, at learning rate ``lr``."""
    return BASE_OPTIMIZERS[config.base_optimizer](config, model, lr)

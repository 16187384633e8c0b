"""Finding the layers K-FAC preconditions as curvature blocks, and what it leaves alone.

One rule per family, tried in order on every module (:data:`BLOCK_RULES`): Kronecker
blocks for the layers an adapter supports (Linear, Conv1d/Conv2d, Embedding), per-group
blocks for grouped convolutions, normalization blocks when a normalization mode is set.
Modules with trainable parameters of their own that no rule takes are listed once in a
warning and keep their plain gradient. Frozen parameters (``requires_grad=False`` at
construction) are never part of a block: a layer with a frozen weight is not registered,
a frozen bias or shift is left out of its layer's block, and both are named in one
warning as never preconditioned (also if unfrozen later: the blocks are fixed here). A
``skip_layers`` entry skips the modules it matches and everything inside them.

Two cases are decided here so that no parameter is preconditioned twice or silently not
at all:

* **shared weights** (an embedding tied to the output head, one ``nn.Linear`` registered
  under two names): the parameter gets the block of the *last* module using it in
  ``named_modules`` order — the output head of a tied language model — and the others get
  none (a layer called several times is one module: every call contributes to its factors,
  the weight-sharing definition of :mod:`spdkfac.layers.linear`);
* **nn.MultiheadAttention** calls its ``out_proj`` through a functional, never through
  its forward, so no hook sees it: the attention module and its children are listed as
  not preconditioned (write attention with ``nn.Linear`` projections, as the built-in GPT
  model does, to precondition them).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter
from torch.nn.utils import parametrize

from spdkfac.curvature.block import CurvatureBlock
from spdkfac.curvature.grouped import GroupedConvBlock
from spdkfac.curvature.kronecker import DiagonalKroneckerBlock, KroneckerBlock, OneSidedBlock
from spdkfac.curvature.normalization import NormalizationBlock
from spdkfac.forms import DampedInverse, InverseForm
from spdkfac.layers import FactorOptions, adapter_for_type, lookup
from spdkfac.layers.batchnorm import is_supported_batchnorm
from spdkfac.layers.normalization import norm_kind
from spdkfac.types import NormalizationMode, SkipEntry, WeightSharing

__all__ = [
    "BLOCK_RULES",
    "BlockSettings",
    "check_materialized",
    "discover_batchnorm_layers",
    "discover_blocks",
    "discover_layers",
]


@dataclass(frozen=True)
class BlockSettings:
    """What discovery needs from the options.

    Attributes:
        factor_options: How adapters compute factors.
        weight_sharing: ``"expand"`` or ``"reduce"`` for layers shared over positions.
        normalization: Mode for every supported normalization layer (None: none).
        batchnorm: Mode for BatchNorm layers only (overrides ``normalization`` for them).
        norm_damping_multiplier: ρ of normalization blocks.
        form: What Kronecker-factored blocks compute from their factors and precondition
            with (the ``inverse_method``'s form).
        factor_dtype: Storage dtype of Kronecker-factored blocks' running factors.
    """

    factor_options: FactorOptions = field(default_factory=FactorOptions)
    weight_sharing: WeightSharing = "expand"
    normalization: NormalizationMode | None = None
    batchnorm: NormalizationMode | None = None
    norm_damping_multiplier: float = 1.0
    form: InverseForm = field(default_factory=lambda: DampedInverse("cholesky"))
    factor_dtype: torch.dtype | None = None

    def norm_mode(self, module: nn.Module) -> NormalizationMode | None:
        """The mode of a supported normalization layer (None: plain gradient)."""
        if self.batchnorm is not None and is_supported_batchnorm(module):
            return self.batchnorm
        return self.normalization


def _trainable_weight(module: nn.Module) -> bool:
    """A trainable ``weight`` Parameter of the module's own: a weight computed by a
    parametrization (``weight_norm``, ``spectral_norm``, ``torch.nn.utils.parametrize``)
    is not a leaf, never gets a ``.grad`` and is left alone (listed as not preconditioned)."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return isinstance(weight, nn.Parameter) and weight.requires_grad


def _kronecker(name: str, module: nn.Module, settings: BlockSettings) -> CurvatureBlock | None:
    adapter = lookup(module)
    if adapter is None or not _trainable_weight(module):
        return None
    adapter = adapter.with_options(settings.factor_options, weight_sharing=settings.weight_sharing)
    adapter = adapter.for_module(module)
    if not settings.form.uses_g:  # A's result alone: only a dense A (not an embedding's)
        return (
            None
            if adapter.diagonal_a
            else OneSidedBlock(
                name, module, adapter, form=settings.form, factor_dtype=settings.factor_dtype
            )
        )
    block_type = DiagonalKroneckerBlock if adapter.diagonal_a else KroneckerBlock
    return block_type(name, module, adapter, form=settings.form, factor_dtype=settings.factor_dtype)


def _grouped(name: str, module: nn.Module, settings: BlockSettings) -> CurvatureBlock | None:
    adapter = adapter_for_type(module)
    if adapter is None or getattr(module, "groups", 1) == 1 or not _trainable_weight(module):
        return None
    if not settings.form.uses_g:  # the one-sided form takes dense layers only
        return None
    adapter = adapter.with_options(settings.factor_options, weight_sharing=settings.weight_sharing)
    adapter = adapter.for_module(module)
    return GroupedConvBlock(
        name, module, adapter, form=settings.form, factor_dtype=settings.factor_dtype
    )


def _normalization(name: str, module: nn.Module, settings: BlockSettings) -> CurvatureBlock | None:
    mode = settings.norm_mode(module)
    if mode is None or norm_kind(module) is None:
        return None
    return NormalizationBlock(
        name, module, mode=mode, damping_multiplier=settings.norm_damping_multiplier
    )


Rule = Callable[[str, nn.Module, BlockSettings], CurvatureBlock | None]

#: Block families in the order they are tried on each module.
BLOCK_RULES: tuple[Rule, ...] = (_kronecker, _grouped, _normalization)


def _name_matches(name: str, entry: str) -> bool:
    return name == entry or name.startswith(entry + ".")


def _entry_matches(name: str, module: nn.Module, entry: SkipEntry) -> bool:
    """A ``skip_layers`` entry: a module name (its children too), ``"re:<pattern>"`` (a
    regular expression the whole name matches), a class name, or an ``nn.Module`` type."""
    if not isinstance(entry, str):
        return isinstance(module, entry)
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], name) is not None
    return _name_matches(name, entry) or type(module).__name__ == entry


def _is_skipped(name: str, module: nn.Module, skip: Iterable[SkipEntry]) -> bool:
    return any(_entry_matches(name, module, entry) for entry in skip)


def check_materialized(model: nn.Module) -> None:
    """A preconditioner needs real parameters (tools that only trace shapes do not).

    Raises:
        ValueError: Lazy (unmaterialized) or ``meta``-device parameters.
    """
    for name, parameter in model.named_parameters():
        if isinstance(parameter, UninitializedParameter):
            raise ValueError(
                f"parameter {name!r} is not materialized (a lazy module): run one forward "
                "pass before constructing the preconditioner"
            )
        if parameter.device.type == "meta":
            raise ValueError(
                f"parameter {name!r} is on the meta device: materialize the model "
                "(e.g. model.to_empty(device=...) and initialize it) first"
            )


def _attention_children(model: nn.Module) -> set[str]:
    """Names of every ``nn.MultiheadAttention`` and of the modules inside one."""
    names: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            names.update(
                f"{name}.{child}" if name else child for child, _ in module.named_modules()
            )
    return names


def _drop_shared(blocks: dict[str, CurvatureBlock]) -> dict[str, CurvatureBlock]:
    """Keep, for each weight, only the last block using it (see the module docstring)."""
    owner: dict[int, str] = {}
    for name, block in blocks.items():
        weight = getattr(block.module, "weight", None)
        if isinstance(weight, Tensor):
            owner[id(weight)] = name
    return {
        name: block
        for name, block in blocks.items()
        if owner.get(id(getattr(block.module, "weight", None)), name) == name
    }


def _skipped_names(model: nn.Module, skip: Iterable[SkipEntry]) -> set[str]:
    """Names of the modules ``skip`` matches and of every module inside one: a container
    skipped by its name, class name or type skips its children."""
    entries = tuple(skip)
    skipped: set[str] = set()
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if _is_skipped(name, module, entries) or (name and parent in skipped):
            skipped.add(name)
    return skipped


_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


def _frozen_parts(name: str, module: nn.Module, settings: BlockSettings) -> list[str]:
    """What of a layer a rule takes (or would take, were its weight trainable) is frozen
    now: the layer's name when its weight is, its ``bias`` when only that is. Frozen parts
    are never preconditioned, even when unfrozen later."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    takes = adapter_for_type(module) is not None or (
        settings.norm_mode(module) is not None and isinstance(module, _NORM_TYPES)
    )
    if not takes or not isinstance(weight, nn.Parameter):
        return []
    if not weight.requires_grad:
        return [name or type(module).__name__]
    bias = getattr(module, "bias", None)
    if isinstance(bias, nn.Parameter) and not bias.requires_grad:
        return [f"{name}.bias" if name else "bias"]
    return []


def _warn_frozen(frozen: list[str]) -> None:
    shown = ", ".join(frozen[:12]) + (f" and {len(frozen) - 12} more" if len(frozen) > 12 else "")
    warnings.warn(
        f"spdkfac: these frozen (requires_grad=False) layers or biases are left out of "
        f"K-FAC and are never preconditioned, also if unfrozen later (to precondition "
        f"them after unfreezing, call remove() and build a new KFACPreconditioner): {shown}",
        UserWarning,
        stacklevel=5,
    )


#: Layer kinds the ``normalization`` option preconditions (by class name).
_NORM_KINDS = frozenset({"LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d",
                         "BatchNorm3d", "SyncBatchNorm"})  # fmt: skip


def _warn_unsupported(unsupported: Counter[str]) -> None:
    listed = ", ".join(f"{kind} ({count})" for kind, count in sorted(unsupported.items()))
    hint = (
        " (nn.MultiheadAttention: write the projections as nn.Linear layers to precondition them)"
        if "MultiheadAttention" in unsupported
        else ""
    )
    if any(kind in _NORM_KINDS for kind in unsupported):
        hint += (
            " (normalization layers: normalization='diagonal' or 'unit-wise', spdkfac train "
            "--normalization, preconditions them)"
        )
    warnings.warn(
        f"spdkfac: these layers are not preconditioned and keep their plain gradient: "
        f"{listed}{hint}",
        UserWarning,
        stacklevel=5,
    )


@dataclass
class _Found:
    blocks: dict[str, CurvatureBlock] = field(default_factory=dict)
    unsupported: Counter[str] = field(default_factory=Counter)
    frozen: list[str] = field(default_factory=list)


def _find(model: nn.Module, skipped: set[str], settings: BlockSettings) -> _Found:
    """Every module's block (by the first rule taking it), and what no rule takes."""
    attention = _attention_children(model)
    found = _Found()
    for name, module in model.named_modules():
        if name in skipped:
            continue
        if name in attention and not isinstance(module, nn.MultiheadAttention):
            continue  # listed once, as the attention module
        if isinstance(module, parametrize.ParametrizationList):
            continue  # listed once, as the parametrized layer
        block = None
        if name not in attention:
            block = next(
                (b for rule in BLOCK_RULES if (b := rule(name, module, settings)) is not None),
                None,
            )
        frozen = _frozen_parts(name, module, settings) if name not in attention else []
        found.frozen.extend(frozen)
        if block is not None:
            found.blocks[name] = block
        elif not frozen and any(p.requires_grad for p in module.parameters(recurse=False)):
            found.unsupported[type(module).__name__] += 1
    return found


def discover_blocks(
    model: nn.Module,
    skip: tuple[SkipEntry, ...],
    settings: BlockSettings | None = None,
    *,
    warn: bool = True,
) -> list[CurvatureBlock]:
    """Every curvature block of ``model`` in ``named_modules`` order: Kronecker and grouped
    blocks first, then normalization blocks; warns once about unsupported layers and once
    about frozen ones (see :func:`_frozen_parts`).

    Raises:
        ValueError: A name in ``skip`` matches no module, or nothing is left to register.
    """
    settings = BlockSettings() if settings is None else settings
    modules = list(model.named_modules())
    for entry in skip:
        if isinstance(entry, str) and not any(_entry_matches(n, m, entry) for n, m in modules):
            raise ValueError(f"skip_layers entry {entry!r} matches no module of the model")
    found = _find(model, _skipped_names(model, skip), settings)
    blocks = _drop_shared(found.blocks)
    if not any(block.section.primary for block in blocks.values()):
        raise ValueError(
            "model has no layer K-FAC supports (nn.Linear, nn.Conv1d/nn.Conv2d, "
            "nn.Embedding) with a trainable weight outside skip_layers"
        )
    if found.unsupported and warn:
        _warn_unsupported(found.unsupported)
    if found.frozen and warn:
        _warn_frozen(found.frozen)
    ordered = list(blocks.values())
    return [b for b in ordered if b.section.primary] + [b for b in ordered if not b.section.primary]


def discover_layers(
    model: nn.Module,
    skip: tuple[SkipEntry, ...],
    options: FactorOptions | None = None,
) -> dict[str, KroneckerBlock]:
    """The Kronecker blocks alone (Linear, Conv1d/Conv2d with ``groups = 1``, Embedding),
    in ``named_modules`` order, for tools that time or trace their factors.

    Raises:
        ValueError: As :func:`discover_blocks`.
    """
    settings = BlockSettings(factor_options=options or FactorOptions())
    blocks = discover_blocks(model, skip, settings)
    return {b.name: b for b in blocks if isinstance(b, KroneckerBlock)}


def discover_batchnorm_layers(
    model: nn.Module, skip: tuple[SkipEntry, ...]
) -> dict[str, nn.Module]:
    """BatchNorm layers with a trainable affine scale outside ``skip``, in ``named_modules`` order.

    See :func:`spdkfac.layers.batchnorm.is_supported_batchnorm` for what qualifies.
    """
    skipped = _skipped_names(model, skip)
    return {
        name: module
        for name, module in model.named_modules()
        if is_supported_batchnorm(module) and name not in skipped
    }

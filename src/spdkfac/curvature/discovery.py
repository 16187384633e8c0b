"""Finding the layers K-FAC preconditions as curvature blocks, and what it leaves alone."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Collection, Iterable

from torch import Tensor, nn

from spdkfac.curvature.block import CurvatureBlock
from spdkfac.curvature.kronecker import KroneckerBlock
from spdkfac.curvature.normalization import NormalizationBlock
from spdkfac.layers import FactorOptions, lookup
from spdkfac.layers.batchnorm import is_supported_batchnorm
from spdkfac.types import NormalizationMode, SkipEntry

__all__ = ["discover_batchnorm_layers", "discover_blocks", "discover_layers", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a ``DistributedDataParallel`` wrapper (else ``model``)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner
    return model


def _name_matches(name: str, entry: str) -> bool:
    return name == entry or name.startswith(entry + ".")


def _is_skipped(name: str, module: nn.Module, skip: Iterable[SkipEntry]) -> bool:
    for entry in skip:
        if isinstance(entry, str):
            if _name_matches(name, entry):
                return True
        elif isinstance(module, entry):
            return True
    return False


def discover_layers(
    model: nn.Module,
    skip: tuple[SkipEntry, ...],
    options: FactorOptions | None = None,
    *,
    handled: Collection[str] = (),
) -> dict[str, KroneckerBlock]:
    """Kronecker blocks in ``named_modules`` order; warns once about unsupported layers.

    A layer is registered when an adapter supports it, its weight requires grad, and it is
    not skipped; its adapter computes factors as ``options`` say. Other modules with
    trainable parameters of their own are listed in one warning (they keep their plain
    gradient), except those named in ``handled`` (curvature kept elsewhere).

    Raises:
        ValueError: A name in ``skip`` matches no module, or nothing is left to register.
    """
    layers: dict[str, KroneckerBlock] = {}
    unsupported: Counter[str] = Counter()
    names = [name for name, _ in model.named_modules()]
    for entry in skip:
        if isinstance(entry, str) and not any(_name_matches(name, entry) for name in names):
            raise ValueError(f"skip_layers entry {entry!r} matches no module of the model")
    for name, module in model.named_modules():
        if _is_skipped(name, module, skip):
            continue
        adapter = lookup(module)
        if adapter is not None:
            weight = getattr(module, "weight", None)
            if isinstance(weight, Tensor) and weight.requires_grad:
                if options is not None:
                    adapter = adapter.with_options(options)
                layers[name] = KroneckerBlock(name, module, adapter)
            continue
        if name not in handled and any(p.requires_grad for p in module.parameters(recurse=False)):
            unsupported[type(module).__name__] += 1
    if not layers:
        raise ValueError(
            "model has no layer K-FAC supports (nn.Linear, nn.Conv2d with groups=1) "
            "outside skip_layers"
        )
    if unsupported:
        listed = ", ".join(f"{kind} ({count})" for kind, count in sorted(unsupported.items()))
        warnings.warn(
            f"spdkfac: these layers are not preconditioned and keep their plain gradient: {listed}",
            UserWarning,
            stacklevel=4,
        )
    return layers


def discover_batchnorm_layers(
    model: nn.Module, skip: tuple[SkipEntry, ...]
) -> dict[str, nn.Module]:
    """BatchNorm layers with a trainable affine scale outside ``skip``, in ``named_modules`` order.

    See :func:`spdkfac.layers.batchnorm.is_supported_batchnorm` for what qualifies.
    """
    return {
        name: module
        for name, module in model.named_modules()
        if is_supported_batchnorm(module) and not _is_skipped(name, module, skip)
    }


def discover_blocks(
    model: nn.Module,
    skip: tuple[SkipEntry, ...],
    options: FactorOptions | None = None,
    *,
    normalization: NormalizationMode | None = None,
    normalization_damping_multiplier: float = 1.0,
) -> list[CurvatureBlock]:
    """Every curvature block of ``model``: Kronecker blocks, then normalization blocks.

    Normalization layers get blocks only when ``normalization`` names a mode; otherwise
    they keep their plain gradient (and are listed among the unsupported layers).

    Raises:
        ValueError: As :func:`discover_layers`.
    """
    normal = (
        {}
        if normalization is None
        else {
            name: NormalizationBlock(
                name,
                module,
                mode=normalization,
                damping_multiplier=normalization_damping_multiplier,
            )
            for name, module in discover_batchnorm_layers(model, skip).items()
        }
    )
    kronecker = discover_layers(model, skip, options, handled=normal.keys())
    return [*kronecker.values(), *normal.values()]

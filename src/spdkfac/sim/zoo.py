"""Models the simulator knows by name: built-in ones, ImageNet CNNs, language models,
torchvision's on request."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from spdkfac import models
from spdkfac.config import KFACConfig
from spdkfac.models import (
    IMAGENET_MODELS,
    MODEL_NAMES,
    TORCHVISION_PREFIX,
    build_model,
    torchvision_builder,
)
from spdkfac.sim.workload import Workload, trace_workload

__all__ = [
    "IMAGENET_MODELS",
    "SIM_MODEL_NAMES",
    "SIM_TEXT_SIZES",
    "ModelEntry",
    "model_by_name",
    "workload_for",
]

#: Language models (token ids in). Read defensively: the text models are recent in
#: :mod:`spdkfac.models`, and the simulator must not depend on their being there.
TEXT_MODELS: Mapping[str, Callable[..., nn.Module]] = getattr(models, "TEXT_MODELS", {})
#: Sized variants of the language models, for projections only (``spdkfac simulate``):
#: name → (the model, its keyword sizes). ``llama-134m``: the tiny LLaMA at width 1024, 8
#: blocks of 16 heads, a 1,024-byte context (134.8 M parameters).
SIM_TEXT_SIZES: Mapping[str, tuple[str, Mapping[str, int]]] = {
    "llama-134m": ("llama", {"d_model": 1024, "n_layer": 8, "n_head": 16, "block_size": 1024})
}
SIM_MODEL_NAMES: tuple[str, ...] = (
    *MODEL_NAMES, *IMAGENET_MODELS, *TEXT_MODELS, *SIM_TEXT_SIZES
)  # fmt: skip


@dataclass(frozen=True)
class ModelEntry:
    """How to build a named model and what one example looks like.

    Attributes:
        name: Lower-case model name.
        build: Builds the model (call it under a ``torch.device`` context for ``meta``).
        input_shape: Shape of one example (a language model's: its sequence length).
        source: ``"spdkfac"`` or ``"torchvision"``.
        vocab_size: For a language model, the token ids' range; None: float inputs.
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    source: str
    vocab_size: int | None = None


def model_by_name(
    name: str, *, input_size: int | None = None, num_classes: int | None = None
) -> ModelEntry:
    """Look a model up by name.

    ImageNet models (``resnet50``, ``resnet152``, ``densenet121``, ``densenet201``) are
    always this project's own (torchvision's layer shapes and names), whether or not
    torchvision is installed; defaults 224x224x3, 1000 classes. Built-in models
    (:data:`spdkfac.models.MODEL_NAMES`) default to CIFAR shapes (32x32x3, 10 classes), as
    ``spdkfac bench`` runs them. Language models (``gpt``) take their default sizes and
    sequences of ``input_size`` tokens (default: the model's ``block_size``).
    ``torchvision:<name>`` asks for a ``torchvision.models`` model explicitly (ImageNet
    defaults); it needs a working torchvision.

    Raises:
        ValueError: An unknown name or a size < 1.
        OptionalPackageError: A ``torchvision:`` name without a working torchvision (also a
            ``ValueError``).
    """
    key = name.lower()
    for label, value in (("input_size", input_size), ("num_classes", num_classes)):
        if value is not None and value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if key in MODEL_NAMES:
        size, classes = input_size or 32, num_classes or 10
        return ModelEntry(
            key,
            lambda: build_model(key, num_classes=classes, in_channels=3, input_size=size),
            (3, size, size),
            "spdkfac",
        )
    if key in TEXT_MODELS or key in SIM_TEXT_SIZES:
        family, sizes = SIM_TEXT_SIZES.get(key, (key, {}))
        text = partial(TEXT_MODELS[family], **sizes)
        with torch.device("meta"):
            probe: Any = text()  # its default sizes, read without memory
        length = input_size or int(probe.block_size)
        return ModelEntry(key, text, (length,), "spdkfac", vocab_size=int(probe.vocab_size))
    size, classes = input_size or 224, num_classes or 1000
    if key in IMAGENET_MODELS:
        builder = IMAGENET_MODELS[key]
        return ModelEntry(key, lambda: builder(num_classes=classes), (3, size, size), "spdkfac")
    if key.startswith(TORCHVISION_PREFIX):
        bare = key[len(TORCHVISION_PREFIX) :]
        vision = torchvision_builder(bare)
        return ModelEntry(bare, lambda: vision(num_classes=classes), (3, size, size), "torchvision")
    raise ValueError(
        f"unknown model {name!r}; choose from {', '.join(SIM_MODEL_NAMES)}"
        f" (or {TORCHVISION_PREFIX}<name> for a torchvision.models model)"
    )


def workload_for(
    name: str,
    *,
    batch_size: int,
    input_size: int | None = None,
    config: KFACConfig | None = None,
) -> Workload:
    """Trace the named model on the ``meta`` device (no memory, no weights), with the
    blocks and inverse form a run of ``config`` registers (default ``KFACConfig()``)."""
    entry = model_by_name(name, input_size=input_size)
    return trace_workload(
        entry.build,
        entry.input_shape,
        batch_size=batch_size,
        name=entry.name,
        device="meta",
        vocab_size=entry.vocab_size,
        config=config,
    )

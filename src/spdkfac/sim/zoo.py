"""Models the simulator knows by name: the built-in ones, ImageNet CNNs, torchvision's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from spdkfac.models import MODEL_NAMES, build_model, optional_torchvision_models
from spdkfac.models.densenet import densenet121, densenet201
from spdkfac.models.imagenet import resnet50, resnet152
from spdkfac.sim.workload import Workload, trace_workload

__all__ = ["IMAGENET_MODELS", "SIM_MODEL_NAMES", "ModelEntry", "model_by_name", "workload_for"]

#: ImageNet-sized models written in this project (3x224x224 inputs, 1000 classes).
IMAGENET_MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet50": resnet50,
    "resnet152": resnet152,
    "densenet121": densenet121,
    "densenet201": densenet201,
}
SIM_MODEL_NAMES: tuple[str, ...] = (*MODEL_NAMES, *IMAGENET_MODELS)


@dataclass(frozen=True)
class ModelEntry:
    """How to build a named model and what one example looks like.

    Attributes:
        name: Lower-case model name.
        build: Builds the model (call it under a ``torch.device`` context for ``meta``).
        input_shape: Shape of one example.
        source: ``"spdkfac"`` or ``"torchvision"``.
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    source: str


def _torchvision(name: str) -> Callable[..., nn.Module] | None:
    models = optional_torchvision_models()
    if models is None or name not in models.list_models():
        return None
    get_model: Callable[..., nn.Module] = models.get_model
    return lambda **kwargs: get_model(name, weights=None, **kwargs)


def model_by_name(
    name: str, *, input_size: int | None = None, num_classes: int | None = None
) -> ModelEntry:
    """Look a model up by name.

    ImageNet models (``resnet50``, ``resnet152``, ``densenet121``, ``densenet201``) use
    torchvision's implementation when it is installed and this project's otherwise (the
    same layer shapes and names); defaults 224x224x3, 1000 classes. Built-in models
    (:data:`spdkfac.models.MODEL_NAMES`) default to CIFAR shapes (32x32x3, 10 classes), as
    ``spdkfac bench`` runs them. Any other torchvision model name works when it is
    installed.

    Raises:
        ValueError: An unknown name or a size < 1.
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
    size, classes = input_size or 224, num_classes or 1000
    vision = _torchvision(key)
    if vision is not None:
        return ModelEntry(key, lambda: vision(num_classes=classes), (3, size, size), "torchvision")
    if key in IMAGENET_MODELS:
        builder = IMAGENET_MODELS[key]
        return ModelEntry(key, lambda: builder(num_classes=classes), (3, size, size), "spdkfac")
    raise ValueError(
        f"unknown model {name!r}; choose from {', '.join(SIM_MODEL_NAMES)}"
        " (or a torchvision.models name when torchvision is installed)"
    )


def workload_for(name: str, *, batch_size: int, input_size: int | None = None) -> Workload:
    """Trace the named model on the ``meta`` device (no memory, no weights)."""
    entry = model_by_name(name, input_size=input_size)
    return trace_workload(
        entry.build, entry.input_shape, batch_size=batch_size, name=entry.name, device="meta"
    )

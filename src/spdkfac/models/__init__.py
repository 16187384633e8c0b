"""Model zoo: an MLP, a small CNN, CIFAR ResNets and a wide ResNet, built by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from torch import nn

from spdkfac.models.cnn import SmallCNN
from spdkfac.models.mlp import MLP
from spdkfac.models.resnet import (
    BasicBlock,
    CifarResNet,
    resnet20,
    resnet32,
    resnet56,
    wide_resnet,
)

__all__ = [
    "MLP",
    "MODEL_NAMES",
    "BasicBlock",
    "CifarResNet",
    "SmallCNN",
    "build_model",
    "optional_torchvision_models",
    "resnet20",
    "resnet32",
    "resnet56",
    "wide_resnet",
]

_Builder = Callable[[int, int, int], nn.Module]

_BUILDERS: dict[str, _Builder] = {
    "mlp": lambda classes, channels, size: MLP(
        num_classes=classes, in_channels=channels, input_size=size
    ),
    "cnn": lambda classes, channels, size: SmallCNN(
        num_classes=classes, in_channels=channels, input_size=size
    ),
    "resnet20": lambda classes, channels, _size: resnet20(
        num_classes=classes, in_channels=channels
    ),
    "resnet32": lambda classes, channels, _size: resnet32(
        num_classes=classes, in_channels=channels
    ),
    "resnet56": lambda classes, channels, _size: resnet56(
        num_classes=classes, in_channels=channels
    ),
    "wrn16-4": lambda classes, channels, _size: wide_resnet(
        16, 4, num_classes=classes, in_channels=channels
    ),
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)
"""Names accepted by :func:`build_model` without torchvision."""


def build_model(
    name: str, *, num_classes: int = 10, in_channels: int = 1, input_size: int = 28
) -> nn.Module:
    """Build a freshly initialized model by name.

    Built-in names are those in :data:`MODEL_NAMES`. If torchvision is installed, any other
    name it knows (e.g. ``"resnet50"``) is built with ``torchvision.models.get_model``
    without pretrained weights; those models expect 3-channel input.

    Args:
        name: Model name, case-insensitive.
        num_classes: Number of output logits.
        in_channels: Channels of the input images.
        input_size: Height and width of the (square) input images.

    Returns:
        The model, in training mode.

    Raises:
        ValueError: If the name is unknown or a size argument is not positive.
    """
    for arg_name, value in (
        ("num_classes", num_classes),
        ("in_channels", in_channels),
        ("input_size", input_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg_name} must be a positive int, got {value!r}")
    key = name.lower()
    builder = _BUILDERS.get(key)
    if builder is not None:
        return builder(num_classes, in_channels, input_size)
    model = _build_torchvision_model(key, num_classes=num_classes, in_channels=in_channels)
    if model is None:
        raise ValueError(
            f"unknown model name {name!r}; valid names are {', '.join(MODEL_NAMES)}"
            " (or any torchvision.models name when torchvision is installed)"
        )
    return model


def optional_torchvision_models() -> ModuleType | None:
    """``torchvision.models``, or None when torchvision cannot be imported.

    Any exception counts as "not available", not only ``ImportError``: a torchvision wheel
    built for another torch (e.g. PyPI's beside the CPU torch wheel) raises
    ``RuntimeError`` while registering its operators.
    """
    try:
        return importlib.import_module("torchvision.models")
    except Exception:  # a broken install is an absent one
        return None


def _build_torchvision_model(name: str, *, num_classes: int, in_channels: int) -> nn.Module | None:
    tv_models = optional_torchvision_models()
    if tv_models is None or name not in tv_models.list_models():
        return None
    if in_channels != 3:
        raise ValueError(
            f"torchvision model {name!r} expects in_channels=3, got in_channels={in_channels}"
        )
    model = tv_models.get_model(name, weights=None, num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise TypeError(f"torchvision.models.get_model({name!r}) returned {type(model).__name__}")
    return model

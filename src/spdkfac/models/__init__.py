"""Model zoo: an MLP, a small CNN, CIFAR ResNets, a wide ResNet, ImageNet CNNs, a GPT and a
tiny LLaMA.

Built-in names always build this project's own models; torchvision's are used only when
asked for with the ``torchvision:`` prefix. :func:`model_kind` says what a model reads:
``"image"`` (float images ``[N, C, H, W]``, one label each) or ``"text"`` (token ids
``[N, T]``, a next-token target at every position).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

from torch import nn

from spdkfac.models.cnn import SmallCNN
from spdkfac.models.densenet import densenet121, densenet201
from spdkfac.models.gpt import GPT
from spdkfac.models.imagenet import resnet50, resnet152
from spdkfac.models.llama import Llama
from spdkfac.models.mlp import MLP
from spdkfac.models.resnet import (
    BasicBlock,
    CifarResNet,
    resnet20,
    resnet32,
    resnet56,
    wide_resnet,
)
from spdkfac.support.optional import optional_import, require

__all__ = [
    "BUILTIN_MODEL_NAMES",
    "GPT",
    "IMAGENET_MODELS",
    "MLP",
    "MODEL_NAMES",
    "TENSOR_PARALLEL_MODELS",
    "TEXT_MODELS",
    "TORCHVISION_PREFIX",
    "BasicBlock",
    "CifarResNet",
    "ModelKind",
    "SmallCNN",
    "build_model",
    "model_kind",
    "optional_torchvision_models",
    "resnet20",
    "resnet32",
    "resnet56",
    "torchvision_builder",
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
"""Built-in small and CIFAR model names accepted by :func:`build_model`."""

#: ImageNet-sized models written in this project (torchvision's layer layout and names).
IMAGENET_MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet50": resnet50,
    "resnet152": resnet152,
    "densenet121": densenet121,
    "densenet201": densenet201,
}


def _llama(
    vocab_size: int = 256,
    block_size: int = 128,
    n_layer: int = 2,
    n_head: int = 4,
    d_model: int = 128,
    dropout: float = 0.0,
) -> nn.Module:
    """The tiny LLaMA (:class:`~spdkfac.models.llama.Llama`) from the GPT's keyword sizes
    (and defaults): a SwiGLU of ``4 * d_model`` units, no positional embedding (the
    ``block_size`` is the context it is built for), no dropout (only 0 accepted)."""
    if dropout:
        raise ValueError(f"llama has no dropout; got dropout={dropout!r}")
    return Llama(vocab_size, d_model, n_layer, n_head, 4 * d_model, block_size=block_size)


#: Language models (token ids in, next-token logits out), built from keyword sizes.
TEXT_MODELS: dict[str, Callable[..., nn.Module]] = {"gpt": GPT, "llama": _llama}
#: Models with a tensor-parallel plan (``spdkfac train --fsdp --tp-size N``; the plans are
#: :data:`spdkfac.comm.tensor_parallel_plan.TENSOR_PARALLEL_PLANS`).
TENSOR_PARALLEL_MODELS: tuple[str, ...] = ("llama",)

#: Every name :func:`build_model` resolves to this project's own implementation.
BUILTIN_MODEL_NAMES: tuple[str, ...] = (*MODEL_NAMES, *IMAGENET_MODELS, *TEXT_MODELS)

#: What a model reads: images (``[N, C, H, W]``) or token ids (``[N, T]``).
ModelKind = Literal["image", "text"]

#: Prefix asking for a ``torchvision.models`` model explicitly (``"torchvision:resnet50"``).
TORCHVISION_PREFIX = "torchvision:"


def model_kind(name: str) -> ModelKind:
    """``"text"`` for a name in :data:`TEXT_MODELS`, else ``"image"`` (case-insensitive)."""
    return "text" if name.lower() in TEXT_MODELS else "image"


def build_model(
    name: str,
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    input_size: int = 28,
    **text_options: Any,
) -> nn.Module:
    """Build a freshly initialized model by name.

    Built-in names (:data:`BUILTIN_MODEL_NAMES`: the CIFAR models, the ImageNet
    ``resnet50``, ``resnet152``, ``densenet121``, ``densenet201`` and the text models
    ``gpt`` and ``llama``) always build this project's own implementation, whether or not
    torchvision is installed. ``"torchvision:<name>"`` builds
    ``torchvision.models.get_model(<name>)`` without pretrained weights (3-channel input);
    it needs a working torchvision.

    Args:
        name: Model name, case-insensitive.
        num_classes: Number of output logits (image models).
        in_channels: Channels of the input images (image models).
        input_size: Height and width of the (square) input images (image models).
        text_options: The constructor's keyword arguments of a text model (for ``gpt``:
            ``vocab_size``, ``block_size``, ``n_layer``, ``n_head``, ``d_model``,
            ``mlp_ratio``, ``dropout``, ``tie_weights``); text models ignore the image
            arguments, image models refuse these.

    Returns:
        The model, in training mode.

    Raises:
        ValueError: If the name is unknown, a size argument is not positive, or
            ``text_options`` are given for an image model.
        OptionalPackageError: A ``torchvision:`` name without a working torchvision (also a
            ``ValueError``).
    """
    key = name.lower()
    text = TEXT_MODELS.get(key)
    if text is not None:
        return text(**text_options)
    if text_options:
        raise ValueError(
            f"model {name!r} is an image model; it takes no {', '.join(sorted(text_options))}"
        )
    for arg_name, value in (
        ("num_classes", num_classes),
        ("in_channels", in_channels),
        ("input_size", input_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg_name} must be a positive int, got {value!r}")
    if key.startswith(TORCHVISION_PREFIX):
        builder = torchvision_builder(key[len(TORCHVISION_PREFIX) :])
        if in_channels != 3:
            raise ValueError(
                f"torchvision model {name!r} expects in_channels=3, got in_channels={in_channels}"
            )
        return builder(num_classes=num_classes)
    small = _BUILDERS.get(key)
    if small is not None:
        return small(num_classes, in_channels, input_size)
    imagenet = IMAGENET_MODELS.get(key)
    if imagenet is not None:
        return imagenet(num_classes=num_classes, in_channels=in_channels)
    raise ValueError(
        f"unknown model name {name!r}; valid names are {', '.join(BUILTIN_MODEL_NAMES)}"
        f" (or {TORCHVISION_PREFIX}<name> for a torchvision.models model)"
    )


def optional_torchvision_models() -> ModuleType | None:
    """``torchvision.models``, or None when torchvision cannot be imported.

    Any exception counts as "not available", not only ``ImportError``: a torchvision wheel
    built for another torch (e.g. PyPI's beside the CPU torch wheel) raises
    ``RuntimeError`` while registering its operators.
    """
    return optional_import("torchvision.models")


def torchvision_builder(name: str) -> Callable[..., nn.Module]:
    """A builder of ``torchvision.models.get_model(name, weights=None, **kwargs)``.

    Args:
        name: A ``torchvision.models`` model name (without the ``torchvision:`` prefix).

    Returns:
        Takes ``get_model``'s keyword arguments (e.g. ``num_classes``), returns the model.

    Raises:
        OptionalPackageError: torchvision is missing or fails to import.
        ValueError: torchvision has no model of that name.
    """
    tv_models = require("torchvision.models", f"model {TORCHVISION_PREFIX}{name}")
    if name not in tv_models.list_models():
        raise ValueError(
            f"unknown model name {TORCHVISION_PREFIX + name!r}: torchvision.models has no "
            f"model {name!r}"
        )
    get_model: Callable[..., object] = tv_models.get_model

    def build(**kwargs: object) -> nn.Module:
        model = get_model(name, weights=None, **kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"torchvision.models.get_model({name!r}) returned {type(model).__name__}"
            )
        return model

    return build

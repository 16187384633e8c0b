"""Batch augmentations seeded by a ``torch.Generator``: running mixup, erasing, crop and flip."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["RunningMixup", "random_crop_flip", "random_erasing", "soft_cross_entropy"]


def _check_images(images: object) -> Tensor:
    if not isinstance(images, Tensor) or images.ndim != 4:
        shape = list(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, C, H, W] tensor, got {shape}")
    return images


def _check_generator(generator: object) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {generator!r}")
    return generator


def _uniform(generator: torch.Generator, *shape: int) -> Tensor:
    """Uniform [0, 1) draws on the generator's device (a CUDA generator cannot fill CPU)."""
    return torch.rand(*shape, generator=generator, device=generator.device)


class RunningMixup:
    """Osawa et al.'s running mixup: mix each batch with the previous *mixed* batch.

    Per sample, ``λ_i ~ Beta(α, α)`` then ``λ_i ← max(λ_i, 1 − λ_i)``, and
    ``x̃_t = λ·x_t + (1 − λ)·x̃_{t−1}``, ``ỹ_t = λ·y_t + (1 − λ)·ỹ_{t−1}``. Unlike mixup,
    the partner is the previous output, so older batches keep contributing with
    geometrically shrinking weight. The first batch, and any batch whose shape differs from
    the previous one (the short last batch of an epoch), is returned unmixed and restarts
    the chain. Train with :func:`soft_cross_entropy`.

    Each rank keeps its own chain; checkpoint it with :meth:`state_dict`.

    Args:
        alpha: α of the Beta distribution, > 0 (Osawa et al.: 0.4 to 1.0).

    Raises:
        ValueError: If ``alpha`` is out of range.
    """

    def __init__(self, alpha: float) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"alpha must be a number > 0, got {alpha!r}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        self.alpha = float(alpha)
        self._inputs: Tensor | None = None
        self._targets: Tensor | None = None

    def __call__(
        self,
        inputs: Tensor,
        targets: Tensor,
        generator: torch.Generator,
        *,
        num_classes: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mix one batch into the chain.

        Args:
            inputs: Floating-point batch ``[B, ...]``.
            targets: Class indices ``[B]`` (integers) or soft targets ``[B, C]``.
            generator: Source of the λ draws (seed it identically for reproducible runs).
            num_classes: C; required with class indices, checked against soft targets.

        Returns:
            The mixed inputs (same shape and dtype) and soft targets ``[B, C]``.

        Raises:
            ValueError: If the inputs, targets, ``num_classes`` or generator are malformed,
                or C differs from the previous batch's.
        """
        if not isinstance(inputs, Tensor) or inputs.ndim < 1 or not inputs.is_floating_point():
            raise ValueError(f"inputs must be a floating-point [B, ...] tensor, got {inputs!r}")
        generator = _check_generator(generator)
        soft = _soft_targets(targets, inputs, num_classes)
        with torch.no_grad():
            previous, previous_targets = self._inputs, self._targets
            if previous_targets is not None and previous_targets.shape[1] != soft.shape[1]:
                raise ValueError(
                    f"targets have {soft.shape[1]} classes but the previous batch had "
                    f"{previous_targets.shape[1]}"
                )
            if previous is None or previous_targets is None or previous.shape != inputs.shape:
                mixed, mixed_targets = inputs.detach().clone(), soft
            else:
                weights = self._draw(inputs.shape[0], generator).to(inputs.device)
                x_weights = weights.to(inputs.dtype).view(-1, *([1] * (inputs.ndim - 1)))
                mixed = torch.lerp(previous.to(inputs), inputs.detach(), x_weights)
                y_weights = weights.to(soft.dtype).unsqueeze(1)
                mixed_targets = torch.lerp(previous_targets.to(soft), soft, y_weights)
        self._inputs, self._targets = mixed, mixed_targets
        return mixed.clone(), mixed_targets.clone()

    def _draw(self, count: int, generator: torch.Generator) -> Tensor:
        # torch's Beta sampler takes no generator: seed numpy's from it instead, so the
        # draws stay a pure function of the generator's state.
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        draws = np.random.default_rng(seed).beta(self.alpha, self.alpha, size=count)
        return torch.from_numpy(np.maximum(draws, 1.0 - draws))

    def reset(self) -> None:
        """Forget the previous batch: the next one is returned unmixed."""
        self._inputs = self._targets = None

    def state_dict(self) -> dict[str, Tensor | None]:
        """The previous mixed batch (inputs and targets), for checkpointing."""
        return {"inputs": self._inputs, "targets": self._targets}

    def load_state_dict(self, state: dict[str, Tensor | None]) -> None:
        """Restore the chain from :meth:`state_dict`.

        Raises:
            ValueError: If keys are missing, or the tensors do not form a batch of inputs
                with ``[B, C]`` soft targets.
        """
        if set(state) != {"inputs", "targets"}:
            raise ValueError(f"state must have keys 'inputs' and 'targets', got {sorted(state)}")
        inputs, targets = state["inputs"], state["targets"]
        if inputs is None or targets is None:
            if inputs is not None or targets is not None:
                raise ValueError("state 'inputs' and 'targets' must both be tensors or both None")
            self.reset()
            return
        if inputs.ndim < 1 or targets.ndim != 2 or targets.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"state 'targets' must have shape [{inputs.shape[0] if inputs.ndim else '?'}, C],"
                f" got {list(targets.shape)}"
            )
        self._inputs, self._targets = inputs.detach().clone(), targets.detach().clone()


def _soft_targets(targets: Tensor, inputs: Tensor, num_classes: int | None) -> Tensor:
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2
    ):
        raise ValueError(f"num_classes must be an int >= 2 or None, got {num_classes!r}")
    if not isinstance(targets, Tensor):
        raise ValueError(f"targets must be a tensor, got {targets!r}")
    batch = inputs.shape[0]
    if targets.shape == (batch,) and not targets.is_floating_point():
        if num_classes is None:
            raise ValueError("num_classes is required when targets are class indices")
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
            low, high = int(targets.min()), int(targets.max())
            raise ValueError(
                f"targets must be class indices in [0, {num_classes}), got [{low}, {high}]"
            )
        return F.one_hot(targets.long(), num_classes).to(inputs.dtype)
    if targets.ndim == 2 and targets.shape[0] == batch and targets.is_floating_point():
        if num_classes is not None and targets.shape[1] != num_classes:
            raise ValueError(
                f"soft targets have {targets.shape[1]} classes, num_classes is {num_classes}"
            )
        return targets.detach().clone()
    raise ValueError(
        f"targets must be integer [{batch}] or float [{batch}, C], "
        f"got {targets.dtype} {list(targets.shape)}"
    )


def soft_cross_entropy(
    logits: Tensor, soft_targets: Tensor, label_smoothing: float = 0.0
) -> Tensor:
    """Mean over the batch of ``−Σ_c t_c·log softmax(logits)_c`` for soft targets.

    With label smoothing ε the targets become ``(1 − ε)·t + ε/C``.

    Args:
        logits: ``[B, C]``.
        soft_targets: ``[B, C]`` class probabilities (e.g. from :class:`RunningMixup`).
        label_smoothing: ε in [0, 1).

    Returns:
        The scalar loss.

    Raises:
        ValueError: If the shapes differ or are not 2-D, or ε is out of range.
    """
    if logits.ndim != 2 or soft_targets.shape != logits.shape:
        raise ValueError(
            f"logits and soft_targets must both be [B, C], got {list(logits.shape)} "
            f"and {list(soft_targets.shape)}"
        )
    if isinstance(label_smoothing, bool) or not (0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    targets = soft_targets.to(logits.dtype)
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / logits.shape[1]
    return -(targets * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def random_erasing(
    images: Tensor,
    generator: torch.Generator,
    *,
    p: float = 0.5,
    area: tuple[float, float] = (0.02, 0.25),
    min_aspect: float = 0.3,
) -> Tensor:
    """Osawa et al.'s random erasing with zeros, on a batch.

    Each image, with probability ``p``, gets one rectangle set to 0 in every channel
    (0 is the mean pixel of standardized inputs). The rectangle covers a fraction
    ``S ~ U(area)`` of the image with aspect ``r ~ U(min_aspect, 1)``, height
    ``round(√(S·H·W·r))`` and width ``round(√(S·H·W/r))`` (clamped to the image), swapped
    with probability 1/2, at a uniform position.

    Args:
        images: ``[B, C, H, W]``; not modified.
        generator: Source of all random draws.
        p: Probability of erasing an image, in [0, 1].
        area: ``(low, high)`` area fractions with ``0 < low <= high <= 1``.
        min_aspect: Smallest aspect ratio, in (0, 1].

    Returns:
        A new tensor like ``images``.

    Raises:
        ValueError: If an argument is malformed or out of range.
    """
    images = _check_images(images)
    generator = _check_generator(generator)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p <= 1.0):
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    if (
        not isinstance(area, tuple)
        or len(area) != 2
        or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in area)
        or not (0.0 < area[0] <= area[1] <= 1.0)
    ):
        raise ValueError(f"area must be (low, high) with 0 < low <= high <= 1, got {area!r}")
    if isinstance(min_aspect, bool) or not (0.0 < min_aspect <= 1.0):
        raise ValueError(f"min_aspect must be in (0, 1], got {min_aspect!r}")
    batch, _, height, width = images.shape
    draws = _uniform(generator, batch, 6).to(images.device, torch.float64)
    erase = draws[:, 0] < p
    pixels = (area[0] + (area[1] - area[0]) * draws[:, 1]) * height * width
    aspect = min_aspect + (1.0 - min_aspect) * draws[:, 2]
    aspect = torch.where(draws[:, 3] < 0.5, aspect, 1.0 / aspect)
    rect_h = torch.sqrt(pixels * aspect).round().long().clamp(1, height)
    rect_w = torch.sqrt(pixels / aspect).round().long().clamp(1, width)
    top = (draws[:, 4] * (height - rect_h + 1)).floor().long()
    left = (draws[:, 5] * (width - rect_w + 1)).floor().long()
    rows = torch.arange(height, device=images.device)
    cols = torch.arange(width, device=images.device)
    in_rows = (rows >= top[:, None]) & (rows < (top + rect_h)[:, None])
    in_cols = (cols >= left[:, None]) & (cols < (left + rect_w)[:, None])
    mask = in_rows[:, :, None] & in_cols[:, None, :] & erase[:, None, None]
    return images.masked_fill(mask[:, None], 0)


def random_crop_flip(images: Tensor, generator: torch.Generator, *, padding: int = 4) -> Tensor:
    """The standard CIFAR augmentation on a batch: pad, random crop, random horizontal flip.

    Each image is zero-padded by ``padding`` on every side (0 is the mean pixel of
    standardized inputs), cropped back to ``H × W`` at a uniform offset in
    ``[0, 2·padding]²``, and mirrored left-right with probability 1/2. Vectorised: one
    gather for the whole batch.

    Args:
        images: ``[B, C, H, W]``; not modified.
        generator: Source of all random draws.
        padding: Pixels of zero padding, an int >= 0 (0: flips only).

    Returns:
        A new tensor like ``images``.

    Raises:
        ValueError: If an argument is malformed or out of range.
    """
    images = _check_images(images)
    generator = _check_generator(generator)
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an int >= 0, got {padding!r}")
    batch, _, height, width = images.shape
    draws = _uniform(generator, batch, 3).to(images.device)
    top = (draws[:, 0] * (2 * padding + 1)).floor().long()
    left = (draws[:, 1] * (2 * padding + 1)).floor().long()
    flip = draws[:, 2] < 0.5
    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    rows = top[:, None] + torch.arange(height, device=images.device)
    offsets = torch.arange(width, device=images.device)
    offsets = torch.where(flip[:, None], width - 1 - offsets, offsets)
    cols = left[:, None] + offsets
    index = torch.arange(batch, device=images.device)[:, None, None]
    # Advanced indices around a slice put their dims first: [B, H, W, C].
    cropped = padded[index, :, rows[:, :, None], cols[:, None, :]]
    return cropped.permute(0, 3, 1, 2).contiguous()

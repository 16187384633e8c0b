"""Tests for running mixup, soft cross-entropy, random erasing and random crop/flip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from spdkfac.data.augment import (
    RunningMixup,
    random_crop_flip,
    random_erasing,
    soft_cross_entropy,
)

__all__: list[str] = []

C = 5


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(step: int, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randn(size, 2, 3, 3, generator=_gen(100 + step))
    labels = (torch.arange(size) + step) % C  # a new class per sample at each step
    return inputs, labels


def _mix(
    mixup: RunningMixup, inputs: torch.Tensor, targets: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    return mixup(inputs, targets, generator, num_classes=C)


def test_running_mixup_mixes_with_previous_mixed_batch() -> None:
    mixup, generator = RunningMixup(0.4), _gen()
    x0, y0 = _batch(0)
    mixed0, soft0 = _mix(mixup, x0, y0, generator)
    torch.testing.assert_close(mixed0, x0)  # step 0 is unmixed
    torch.testing.assert_close(soft0, F.one_hot(y0, C).float())
    previous, previous_soft = mixed0, soft0
    for step in (1, 2, 3):
        x, y = _batch(step)
        mixed, soft = _mix(mixup, x, y, generator)
        # the new class carried no weight before, so its target mass is λ_i
        lam = soft[torch.arange(6), y]
        assert bool(((lam >= 0.5) & (lam <= 1.0)).all())
        torch.testing.assert_close(
            soft, lam[:, None] * F.one_hot(y, C) + (1 - lam[:, None]) * previous_soft
        )
        expected = lam.view(-1, 1, 1, 1) * x + (1 - lam.view(-1, 1, 1, 1)) * previous
        torch.testing.assert_close(mixed, expected)
        torch.testing.assert_close(soft.sum(1), torch.ones(6))
        previous, previous_soft = mixed, soft


@pytest.mark.parametrize("alpha", [0.4, 1.0])
def test_running_mixup_lambda_distribution(alpha: float) -> None:
    mixup, generator = RunningMixup(alpha), _gen(3)
    size = 20000
    inputs = torch.zeros(size, 1)
    mixup(inputs, torch.zeros(size, dtype=torch.long), generator, num_classes=2)
    _, soft = mixup(inputs, torch.ones(size, dtype=torch.long), generator, num_classes=2)
    lam = soft[:, 1].double().numpy()
    draws = np.random.default_rng(12345).beta(alpha, alpha, size=200000)
    reference = np.maximum(draws, 1 - draws)
    assert lam.min() >= 0.5
    assert lam.mean() == pytest.approx(reference.mean(), abs=0.01)
    assert np.quantile(lam, 0.25) == pytest.approx(np.quantile(reference, 0.25), abs=0.015)
    if alpha == 1.0:
        assert lam.mean() == pytest.approx(0.75, abs=0.01)


def test_running_mixup_is_reproducible_and_checkpointable() -> None:
    first, second = RunningMixup(0.6), RunningMixup(0.6)
    gen_a, gen_b = _gen(7), _gen(7)
    for step in range(3):
        out_a, out_b = _mix(first, *_batch(step), gen_a), _mix(second, *_batch(step), gen_b)
        torch.testing.assert_close(out_a, out_b)
    restored = RunningMixup(0.6)
    restored.load_state_dict(first.state_dict())
    gen_c = torch.Generator().set_state(gen_a.get_state())
    torch.testing.assert_close(_mix(restored, *_batch(3), gen_c), _mix(first, *_batch(3), gen_a))
    fresh = RunningMixup(0.6)
    x, y = _batch(4)
    assert not torch.allclose(_mix(fresh, x, y, _gen())[0], _mix(first, x, y, _gen())[0])


def test_running_mixup_restarts_on_batch_size_change() -> None:
    mixup, generator = RunningMixup(1.0), _gen()
    _mix(mixup, *_batch(0), generator)
    _mix(mixup, *_batch(1), generator)
    for size in (4, 6):  # short last batch, then the next epoch's first batch
        x, y = _batch(2, size)
        mixed, soft = _mix(mixup, x, y, generator)
        torch.testing.assert_close(mixed, x)
        torch.testing.assert_close(soft, F.one_hot(y, C).float())
    mixed, _ = _mix(mixup, *_batch(3), generator)
    assert not torch.allclose(mixed, _batch(3)[0])
    mixup.reset()
    torch.testing.assert_close(_mix(mixup, *_batch(5), generator)[0], _batch(5)[0])


def test_running_mixup_soft_targets_and_outputs_are_copies() -> None:
    mixup, generator = RunningMixup(1.0), _gen()
    x, y = _batch(0)
    soft_in = F.one_hot(y, C).float() * 0.8 + 0.04
    mixed, soft = mixup(x, soft_in, generator)  # num_classes comes from the soft targets
    torch.testing.assert_close(soft, soft_in)
    mixed.zero_()  # must not corrupt the chain
    x1, y1 = _batch(1)
    mixed1, soft1 = _mix(mixup, x1, y1, generator)
    lam = (soft1[torch.arange(6), y1] - 0.04) / 0.96  # soft_in puts 0.04 on class y1
    expected = lam[:, None] * F.one_hot(y1, C) + (1 - lam[:, None]) * soft_in
    torch.testing.assert_close(soft1, expected)  # mixed with the soft targets given
    assert mixed1.abs().sum() > 0
    assert not torch.allclose(mixed1, x1)
    with pytest.raises(ValueError, match="4 classes but the previous batch had 5"):
        mixup(x1, torch.full((6, 4), 0.25), generator)


def _labels(offset: int = 0) -> torch.Tensor:
    return torch.arange(6) + offset


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: RunningMixup(0.0), "alpha"),
        (lambda: RunningMixup(float("nan")), "alpha"),
        (lambda: RunningMixup(0.4)(*_batch(0), None), "generator"),  # type: ignore[arg-type]
        (lambda: RunningMixup(0.4)(*_batch(0), _gen()), "num_classes is required"),
        (lambda: RunningMixup(0.4)(*_batch(0), _gen(), num_classes=1), "num_classes must"),
        (lambda: _mix(RunningMixup(0.4), _batch(0)[0], _labels(5), _gen()), r"\[0, 5\), got \[5"),
        (lambda: _mix(RunningMixup(0.4), _batch(0)[0], torch.zeros(6, 4), _gen()), "4 classes"),
        (lambda: _mix(RunningMixup(0.4), _batch(0)[0], torch.zeros(5), _gen()), "targets must"),
        (lambda: _mix(RunningMixup(0.4), _labels().long(), _labels(), _gen()), "inputs"),
        (lambda: RunningMixup(0.4).load_state_dict({"inputs": None}), "keys"),
        (
            lambda: RunningMixup(0.4).load_state_dict(
                {"inputs": torch.zeros(2, 3), "targets": torch.zeros(3, 3)}
            ),
            "targets",
        ),
        (
            lambda: RunningMixup(0.4).load_state_dict({"inputs": torch.zeros(2), "targets": None}),
            "both",
        ),
    ],
)
def test_running_mixup_rejects(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_soft_cross_entropy_matches_torch() -> None:
    logits = torch.randn(8, C, generator=_gen(), requires_grad=True)
    labels = torch.arange(8) % C
    torch.testing.assert_close(
        soft_cross_entropy(logits, F.one_hot(labels, C).float()), F.cross_entropy(logits, labels)
    )
    soft = torch.softmax(torch.randn(8, C, generator=_gen(1)), dim=1)
    for smoothing in (0.0, 0.1):
        torch.testing.assert_close(
            soft_cross_entropy(logits, soft, smoothing),
            F.cross_entropy(logits, soft, label_smoothing=smoothing),
        )
    soft_cross_entropy(logits, soft, 0.1).backward()
    assert logits.grad is not None
    with pytest.raises(ValueError, match="label_smoothing"):
        soft_cross_entropy(logits, soft, 1.0)
    with pytest.raises(ValueError, match="soft_targets"):
        soft_cross_entropy(logits, soft[:, :3])


def _rectangle(zero: torch.Tensor) -> tuple[int, int]:
    """Height and width of the zero region, asserting it is one full rectangle."""
    rows, cols = torch.nonzero(zero, as_tuple=True)
    height = int(rows.max() - rows.min() + 1)
    width = int(cols.max() - cols.min() + 1)
    assert int(zero.sum()) == height * width
    return height, width


def test_random_erasing_rectangles() -> None:
    images = torch.rand(300, 3, 32, 32, generator=_gen()) + 0.5  # no zeros
    original = images.clone()
    out = random_erasing(images, _gen(1), p=1.0)
    assert torch.equal(images, original)
    shapes = []
    for image, source in zip(out, images, strict=True):
        zero = image == 0
        assert torch.equal(zero[0], zero[1]) and torch.equal(zero[0], zero[2])
        assert torch.equal(image[~zero], source[~zero])
        height, width = _rectangle(zero[0])
        fraction = height * width / (32 * 32)
        assert 0.015 <= fraction <= 0.27
        assert 0.3 * 0.75 <= height / width <= 1 / 0.3 / 0.75
        shapes.append((height, width))
    assert any(h > w for h, w in shapes) and any(w > h for h, w in shapes)
    fractions = [h * w / 1024 for h, w in shapes]
    assert float(np.mean(fractions)) == pytest.approx(0.135, abs=0.02)
    torch.testing.assert_close(random_erasing(images, _gen(1), p=1.0), out)


def test_random_erasing_probability_and_shapes() -> None:
    images = torch.ones(400, 1, 8, 40)
    erased = (random_erasing(images, _gen(2), p=0.5) == 0).flatten(1).any(1)
    assert 160 <= int(erased.sum()) <= 240
    assert torch.equal(random_erasing(images, _gen(2), p=0.0), images)
    out = random_erasing(images, _gen(2), p=1.0, area=(0.25, 0.25), min_aspect=1.0)
    for image in out[:20]:
        height, width = _rectangle(image[0] == 0)
        assert abs(height * width - 80) <= 20
    for kwargs, name in [
        ({"p": 1.5}, "p"),
        ({"area": (0.3, 0.2)}, "area"),
        ({"area": (0.0, 0.2)}, "area"),
        ({"min_aspect": 0.0}, "min_aspect"),
    ]:
        with pytest.raises(ValueError, match=name):
            random_erasing(images, _gen(), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="images"):
        random_erasing(torch.ones(3, 8, 8), _gen())


def _matching_crop(
    output: torch.Tensor, source: torch.Tensor, padding: int
) -> tuple[int, int, bool]:
    padded = F.pad(source, (padding,) * 4)
    matches = []
    size = source.shape[-1]
    for top in range(2 * padding + 1):
        for left in range(2 * padding + 1):
            crop = padded[:, top : top + size, left : left + size]
            for flip in (False, True):
                if torch.equal(output, crop.flip(-1) if flip else crop):
                    matches.append((top, left, flip))
    assert len(matches) == 1, matches
    return matches[0]


@pytest.mark.parametrize("padding", [0, 4])
def test_random_crop_flip_outputs_are_padded_crops(padding: int) -> None:
    images = torch.rand(256, 3, 12, 12, generator=_gen()) + 0.1
    original = images.clone()
    out = random_crop_flip(images, _gen(5), padding=padding)
    assert torch.equal(images, original)
    assert out.shape == images.shape and out.dtype == images.dtype
    found = [_matching_crop(o, i, padding) for o, i in zip(out, images, strict=True)]
    tops = {top for top, _, _ in found}
    lefts = {left for _, left, _ in found}
    assert tops == set(range(2 * padding + 1)) and lefts == tops
    flips = sum(flip for _, _, flip in found)
    assert 90 <= flips <= 166
    torch.testing.assert_close(random_crop_flip(images, _gen(5), padding=padding), out)


def test_random_crop_flip_rejects() -> None:
    with pytest.raises(ValueError, match="padding"):
        random_crop_flip(torch.ones(2, 3, 8, 8), _gen(), padding=-1)
    with pytest.raises(ValueError, match="generator"):
        random_crop_flip(torch.ones(2, 3, 8, 8), 0)  # type: ignore[arg-type]

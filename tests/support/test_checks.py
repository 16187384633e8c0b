"""The option validators: numpy scalars and 0-d tensors are numbers; bools, non-finite
values and tensors with elements are not."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from spdkfac.support.checks import check_int, check_number


@pytest.mark.parametrize(
    "value",
    [np.float32(0.25), np.float64(0.25), np.float16(0.25), np.int64(2), np.array(0.25),
     torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64), torch.tensor(2),
     torch.tensor(0.25, requires_grad=True), Fraction(1, 4)],
    ids=repr,
)  # fmt: skip
def test_array_scalars_are_numbers(value: object) -> None:
    number = check_number("lr", value)
    assert type(number) is float
    item = value.item() if hasattr(value, "item") else float(value)  # type: ignore[arg-type]
    assert number == item


@pytest.mark.parametrize(
    "value",
    [np.bool_(True), torch.tensor(True), True, torch.tensor([0.1]), np.array([0.1]),
     torch.zeros(2), torch.tensor(0.1, device="meta"), torch.tensor(1 + 1j), "0.1", None],
    ids=repr,
)  # fmt: skip
def test_bools_and_non_scalars_are_not_numbers(value: object) -> None:
    with pytest.raises(ValueError, match=r"^lr must be a number, got ") as info:
        check_number("lr", value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "value",
    [np.float32("nan"), np.float64("inf"), torch.tensor(float("nan")), torch.tensor(-1.0),
     np.float32(0.0)],
    ids=repr,
)  # fmt: skip
def test_array_scalars_are_checked_like_floats(value: object) -> None:
    with pytest.raises(ValueError, match=r"^damping must be a finite number > 0, got "):
        check_number("damping", value)


@pytest.mark.parametrize(
    "value", [np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3), np.array(3)], ids=repr
)
def test_array_integers_are_ints(value: object) -> None:
    number = check_int("inv_update_steps", value)
    assert type(number) is int and number == 3


@pytest.mark.parametrize(
    "value",
    [np.float32(3.0), torch.tensor(3.0), np.bool_(True), torch.tensor(True), torch.tensor([3]),
     np.int64(0), 3.0],
    ids=repr,
)  # fmt: skip
def test_non_integers_and_small_ints_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"^inv_update_steps must be an int >= 1, got "):
        check_int("inv_update_steps", value)

"""Block state helpers: per-step accumulation, running averages, saving and restoring."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from spdkfac.curvature.block import STATE_SECTIONS, CurvatureBlock, StateSection
from spdkfac.linalg import pack_triu, unpack_triu

__all__ = [
    "FactorAccumulator",
    "blocks_memory",
    "blocks_state_dict",
    "load_blocks_state",
    "running_average",
    "symmetric_running_average",
    "without_inverses",
]


@dataclass
class FactorAccumulator:
    """Weighted mean of the contributions to one exchange slot captured during one step.

    Several forward/backward calls before one ``step()`` (gradient accumulation, a layer
    used twice) each add their statistic, weighted by the number of examples it averages.
    """

    total: Tensor | None = None
    weight: int = 0
    calls: int = 0

    def add(self, factor: Tensor, weight: int) -> None:
        """Add one call's statistic, which averages ``weight`` examples."""
        if self.total is None:
            self.total = factor if weight == 1 else factor.mul(weight)
        else:
            self.total.add_(factor, alpha=weight)
        self.weight += weight
        self.calls += 1

    def count(self) -> None:
        """Count one call whose statistic another rank forms (nothing added, weight 0)."""
        self.calls += 1

    def mean(self) -> Tensor | None:
        """The weighted mean of what was added, or None when nothing was."""
        if self.total is None:
            return None
        return self.total if self.weight == 1 else self.total.div(self.weight)

    def clear(self) -> None:
        """Forget every contribution."""
        self.total = None
        self.weight = 0
        self.calls = 0


def running_average(current: Tensor | None, new: Tensor, decay: float) -> Tensor:
    """``ξ·current + (1−ξ)·new``; the first update (``current is None``) sets the factor."""
    if current is None:
        return new.clone()
    if decay == 1.0:
        return current
    return current.mul_(decay).add_(new, alpha=1.0 - decay)


def symmetric_running_average(current: Tensor | None, new: Tensor, decay: float) -> Tensor:
    """:func:`running_average` of a symmetric factor, kept in the form ``new`` arrives in.

    The average is elementwise, so on packed upper triangles it is exactly the average of
    the full matrices, at half the cost. ``new`` is packed (``[d(d+1)/2]``, from a group's
    exchange) or full (``[d, d]``, from a group of one); a ``current`` of the other form
    (restored from a state dict, which holds full matrices) is converted once.
    """
    if current is not None and current.dim() != new.dim():
        current = pack_triu(current) if new.dim() == 1 else unpack_triu(current, new.shape[-1])
    return running_average(current, new, decay)


def _is_inverse(key: str) -> bool:
    return key.endswith("inverse")


def _members(blocks: Sequence[CurvatureBlock], section: StateSection) -> list[CurvatureBlock]:
    return [block for block in blocks if block.section == section]


def blocks_state_dict(
    blocks: Sequence[CurvatureBlock],
    mode: str | None,
    *,
    inverses: bool = True,
    states: Mapping[str, Mapping[str, Tensor | None]] | None = None,
) -> dict[str, Any]:
    """Copies of every block's tensors, by each block's :class:`StateSection` (a
    non-primary section only when it has blocks); inverses as None unless ``inverses``.
    ``states`` replaces the blocks' own (e.g. gathered from their owners)."""
    result: dict[str, Any] = {}
    for section in STATE_SECTIONS:
        members = _members(blocks, section)
        if not members and not section.primary:
            continue
        entries = {}
        for block in members:
            state = block.state() if states is None else states[block.name]
            entries[block.name] = {
                key: None
                if value is None or (_is_inverse(key) and not inverses)
                else value.detach().clone()
                for key, value in state.items()
            }
        result[section.key] = section.pack(entries, mode)
    return result


def without_inverses(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of a preconditioner's state dict whose inverses are all None (as
    saved with ``inverses=False``): loading it recomputes them."""

    def strip(layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        return {
            name: {key: None if _is_inverse(key) else value for key, value in entry.items()}
            for name, entry in layers.items()
        }

    result = dict(state_dict)
    for section in STATE_SECTIONS:
        saved = state_dict.get(section.key)
        if saved is not None:
            result[section.key] = section.replaced(saved, strip(section.entries(saved)))
    return result


def _restored(
    blocks: Sequence[CurvatureBlock], saved: Mapping[str, Any], prefix: str
) -> list[tuple[CurvatureBlock, dict[str, Tensor | None]]]:
    names = {block.name for block in blocks}
    if set(saved) != names:
        missing = sorted(names - set(saved))
        extra = sorted(set(saved) - names)
        raise ValueError(
            f"state_dict {prefix}layers differ from the registered ones: missing {missing}, "
            f"unexpected {extra}"
        )
    restored = []
    for block in blocks:
        entry: dict[str, Tensor | None] = {}
        fresh = set(getattr(block, "moments", ()))  # a form's running state
        for key, shape in block.state_shapes().items():
            if key not in saved[block.name] and key not in fresh:
                raise ValueError(f"state_dict {prefix}layer {block.name!r} has no {key}")
            # Saved by a form without this state (e.g. cholesky into eigen-adam): fresh.
            value = saved[block.name].get(key)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"state_dict {prefix}{key} of layer {block.name!r} has shape "
                    f"{tuple(value.shape)}, expected {shape}"
                )
            entry[key] = None if value is None else value.to(block.device).clone()
        restored.append((block, entry))
    return restored


def load_blocks_state(
    blocks: Sequence[CurvatureBlock], state_dict: Mapping[str, Any], mode: str | None
) -> bool:
    """Restore :func:`blocks_state_dict`'s output; validates everything before writing.

    Returns:
        Whether some factor came without its inverse (saved with ``inverses=False``): the
        inverses should be recomputed at the next step.

    A form's running state (:attr:`~spdkfac.forms.InverseForm.moments`) the state dict
    does not hold — saved with another form, e.g. ``"cholesky"`` into ``"eigen-adam"``
    or without ``grafting="adam"`` — starts fresh; state of another form is ignored.

    Raises:
        ValueError: When the sections, the mode, the block names or a shape differ, or a
            factor or inverse entry is missing.
    """
    restored = []
    for section in STATE_SECTIONS:
        members = _members(blocks, section)
        saved = state_dict[section.key] if section.primary else state_dict.get(section.key)
        section.check(saved, mode, len(members))
        if saved is not None:
            restored.extend(_restored(members, section.entries(saved), section.label))
    stale = False
    for block, entry in restored:
        block.restore(entry)
        factors = [v for k, v in entry.items() if not _is_inverse(k)]
        inverses = [v for k, v in entry.items() if _is_inverse(k)]
        stale |= any(v is not None for v in factors) and any(v is None for v in inverses)
    return stale


def blocks_memory(blocks: Sequence[CurvatureBlock]) -> dict[str, int]:
    """Bytes of the factors and of the inverses the blocks hold, as held (packed factors
    count their triangle)."""
    totals = {"factors": 0, "inverses": 0}
    for block in blocks:
        for key, value in block.stored().items():
            if value is not None:
                kind = "inverses" if _is_inverse(key) else "factors"
                totals[kind] += value.numel() * value.element_size()
    return totals

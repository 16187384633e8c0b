"""The preconditioner's state: counters, saving and restoring it, held by a plain
collaborator (:class:`StateKeeper`) that the preconditioner calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spdkfac.comm import Communicator
from spdkfac.config import KFACConfig
from spdkfac.curvature import (
    NORMALIZATION_SECTION,
    CurvatureBlock,
    blocks_memory,
    blocks_state_dict,
    load_blocks_state,
    without_inverses,
)
from spdkfac.engine.assembly import Stages
from spdkfac.engine.autotune import AutoTuner
from spdkfac.engine.checkpoint import dcp_state, from_dcp

__all__ = ["STATE_FORMAT", "Counters", "StateKeeper"]

#: Version of the state dict's layout.
STATE_FORMAT = 1


@dataclass
class Counters:
    """A preconditioner's step counters.

    Attributes:
        step: Completed ``step()`` calls (including skipped ones).
        skipped: ``step()`` calls that skipped the update on non-finite values.
        stale_inverses: A state without inverses was loaded: recompute them next step.
    """

    step: int = 0
    skipped: int = 0
    stale_inverses: bool = False


class StateKeeper:
    """``state_dict`` / ``load_state_dict`` / ``memory_bytes`` of a preconditioner's blocks.

    Args:
        blocks: The curvature blocks, in the same order on every rank.
        communicator: The group (the world size a saved ``auto`` choice was made for).
    """

    def __init__(self, blocks: Sequence[CurvatureBlock], communicator: Communicator) -> None:
        self._blocks = blocks
        self._communicator = communicator

    def kronecker(self) -> dict[str, CurvatureBlock]:
        """The Kronecker-factored blocks by name (the state dict's main section)."""
        return {block.name: block for block in self._blocks if block.section.primary}

    def normalization(self) -> dict[str, CurvatureBlock]:
        """The normalization blocks by name."""
        return {b.name: b for b in self._blocks if b.section is NORMALIZATION_SECTION}

    def seen_layers(self, stages: Stages) -> list[str]:
        """Kronecker-factored module names captured so far, in forward order."""
        registered = self.kronecker()
        return [name for name in stages.collector.forward_order if name in registered]

    def save(
        self,
        stages: Stages,
        counters: Counters,
        config: KFACConfig,
        tuner: AutoTuner | None = None,
        inverses: bool = True,
    ) -> dict[str, Any]:
        """The state dict (see :meth:`~spdkfac.KFACPreconditioner.state_dict`); a
        collective when the final stage's owners hold the state."""
        states = stages.final.gather_state()
        chosen = self._auto(tuner)
        auto = {} if chosen is None else {"auto": chosen}
        return {
            **self._header(stages, counters, config),
            **blocks_state_dict(self._blocks, config.norm_mode, inverses=inverses, states=states),
            **auto,
        }

    def _header(self, stages: Stages, counters: Counters, config: KFACConfig) -> dict[str, Any]:
        """The format, counters, forward order and inverse form every state carries."""
        return {
            "format": STATE_FORMAT,
            "steps": counters.step,
            "skipped_steps": counters.skipped,
            "forward_order": self.seen_layers(stages),
            "inverse_form": config.inverse_form.kind,
        }

    def dcp(
        self,
        stages: Stages,
        counters: Counters,
        config: KFACConfig,
        tuner: AutoTuner | None = None,
        inverses: bool = True,
    ) -> dict[str, Any]:
        """This rank's DCP state (see :mod:`spdkfac.engine.checkpoint`): the blocks the
        final stage keeps here, no collective; a fresh one is the template to load into."""
        meta = {
            **self._header(stages, counters, config),
            "norm_mode": config.norm_mode,
            "auto": self._auto(tuner),
        }
        return dcp_state(self._blocks, stages.final.held(), meta, inverses=inverses)

    def from_dcp(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The ordinary state dict of a DCP state ``dcp.load`` filled (for :meth:`load`)."""
        return from_dcp(state, self._blocks)

    def checked(self, state_dict: Mapping[str, Any], config: KFACConfig) -> Mapping[str, Any]:
        """``state_dict`` as it can be loaded: its inverses dropped when they were saved in
        another form (they are recomputed at the next step).

        Raises:
            ValueError: When the format differs.
        """
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"state_dict format {state_dict.get('format')!r} is not {STATE_FORMAT}"
            )
        if state_dict.get("inverse_form", "inverse") != config.inverse_form.kind:
            return without_inverses(state_dict)
        return state_dict

    def load(
        self,
        state_dict: Mapping[str, Any],
        stages: Stages,
        counters: Counters,
        config: KFACConfig,
    ) -> None:
        """Restore a :meth:`checked` state dict into the blocks and ``counters``.

        Raises:
            ValueError: When the registered layers or a factor shape differ.
        """
        counters.stale_inverses = load_blocks_state(self._blocks, state_dict, config.norm_mode)
        stages.final.after_load()
        stages.collector.clear()
        counters.step = int(state_dict["steps"])
        counters.skipped = int(state_dict.get("skipped_steps", 0))
        registered = self.kronecker()
        stages.collector.forward_order[:] = [
            name for name in state_dict.get("forward_order", []) if name in registered
        ]

    def _auto(self, tuner: AutoTuner | None) -> dict[str, Any] | None:
        """``strategy="auto"``'s choice and the world size it was made for (None: not
        auto, or not chosen yet)."""
        choice = None if tuner is None else tuner.choice
        if choice is None:
            return None
        return {"chosen": choice.chosen, "world_size": self._communicator.world_size}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the factors and of the inverses this rank holds (live tensors)."""
        return blocks_memory(self._blocks)

    def discarded_inverse_phase(self, stages: Stages, damping: float) -> None:
        """Run the inverse phase and put every block's state back as it was (``auto``
        timing a candidate's inverse phase without changing the results; collective)."""
        kept = [(block, block.stored(), getattr(block, "damping", None)) for block in self._blocks]
        stages.inverses.run(self._blocks, damping)
        for block, stored, previous in kept:
            block.restore(stored)
            if previous is not None:
                block.damping = previous  # type: ignore[attr-defined]

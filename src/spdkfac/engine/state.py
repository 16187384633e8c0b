"""The preconditioner's state: saving, restoring, and moving it between compositions.

A mixin of :class:`~spdkfac.KFACPreconditioner` (the attributes below are its own), kept
apart so the step stays readable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from spdkfac.comm import Communicator
from spdkfac.config import KFACConfig
from spdkfac.curvature import (
    CurvatureBlock,
    FactorCollector,
    blocks_memory,
    blocks_state_dict,
    load_blocks_state,
    without_inverses,
)
from spdkfac.engine.assembly import Stages
from spdkfac.engine.autotune import AutoTuner
from spdkfac.engine.inversion import InversePhase
from spdkfac.engine.owners import OwnerUpdate, drop_unowned, gather_states
from spdkfac.engine.update import ReplicatedUpdate
from spdkfac.strategies import Strategy

__all__ = ["STATE_FORMAT", "Snapshots"]

#: Version of the state dict's layout.
STATE_FORMAT = 1


class Snapshots:
    """``state_dict`` / ``load_state_dict`` / ``memory_bytes`` and composition switches."""

    config: KFACConfig
    _blocks: list[CurvatureBlock]
    _communicator: Communicator
    _update: ReplicatedUpdate | OwnerUpdate
    _collector: FactorCollector
    _inverses: InversePhase
    _stages: Stages
    _auto: AutoTuner | None
    _assemble: Callable[..., Stages]
    _step: int
    _skipped_steps: int
    _stale_inverses: bool

    def _use(self, stages: Stages) -> None:
        self._stages = stages
        self._update = stages.update
        self._inverses = stages.inverses
        self._collector = stages.collector

    def _switch(self, composition: Strategy) -> None:
        """Move to ``composition``'s stages, keeping every factor and inverse (collective:
        an owner-computes composition gathers its owners' state)."""
        state = self.state_dict()
        self._collector.remove()
        self._use(self._assemble(composition, config=self.config))
        self.load_state_dict(state)

    def _discarded_inverse_phase(self, damping: float) -> None:
        """Run the inverse phase and put every block's state back as it was (``auto``
        timing a candidate's inverse phase without changing the results; collective)."""
        kept = [(block, block.stored(), getattr(block, "damping", None)) for block in self._blocks]
        self._inverses.run(self._blocks, damping)
        for block, stored, previous in kept:
            block.restore(stored)
            if previous is not None:
                block.damping = previous  # type: ignore[attr-defined]

    def _section(self, section: str) -> dict[str, CurvatureBlock]:
        return {block.name: block for block in self._blocks if block.section == section}

    def _seen_layers(self) -> list[str]:
        """Kronecker-factored module names captured so far, in forward order."""
        registered = self._section("layers")
        return [name for name in self._collector.forward_order if name in registered]

    def state_dict(self, *, inverses: bool = True) -> dict[str, Any]:
        """Factors, inverses and counters, as a dict of copies (safe to ``torch.save``).

        The state dict holds every layer's factors and inverses, so any rank's resumes any
        world size. With ``strategy="osawa"`` only a layer's owner holds them: then
        ``state_dict()`` gathers them from the owners and must be called on every rank
        (a collective). ``inverses=False`` leaves the inverses out (about half the
        size): loading it recomputes them, with the current damping, at the next step.
        With ``strategy="auto"`` it records the choice and the world size it was made for.
        """
        states = None
        if isinstance(self._update, OwnerUpdate) and self._communicator.world_size > 1:
            states = gather_states(self._blocks, self._update.owner_of, self._communicator)
        choice = None if self._auto is None else self._auto.choice
        return {
            "format": STATE_FORMAT,
            "steps": self._step,
            "skipped_steps": self._skipped_steps,
            "forward_order": self._seen_layers(),
            "inverse_form": self.config.inverse_form.kind,
            **blocks_state_dict(
                self._blocks, self.config.norm_mode, inverses=inverses, states=states
            ),
            **(
                {}
                if choice is None
                else {
                    "auto": {"chosen": choice.chosen, "world_size": self._communicator.world_size}
                }
            ),
        }

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the factors and of the inverses this rank holds (live tensors)."""
        return blocks_memory(self._blocks)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the layers must match exactly.

        With ``strategy="auto"``, a choice saved at the same world size is kept (no new
        trials); after a world-size change the trials run again.

        Raises:
            ValueError: When the format, the registered layers or a factor shape differ.
        """
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"state_dict format {state_dict.get('format')!r} is not {STATE_FORMAT}"
            )
        if state_dict.get("inverse_form", "inverse") != self.config.inverse_form.kind:
            state_dict = without_inverses(state_dict)  # recomputed at the next step
        saved = state_dict.get("auto")
        if self._auto is not None and saved is not None:
            if saved["world_size"] == self._communicator.world_size:
                self._auto.adopt(saved["chosen"], int(state_dict["steps"]))
            if self._auto.current.name != self._stages.composition.name:
                self._collector.remove()
                self._use(self._assemble(self._auto.current, config=self.config))
        self._stale_inverses = load_blocks_state(self._blocks, state_dict, self.config.norm_mode)
        if isinstance(self._update, OwnerUpdate):  # owners were planned for this world size
            drop_unowned(self._blocks, self._update.owner_of, self._communicator.rank)
        self._collector.clear()
        self._step = int(state_dict["steps"])
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
        registered = self._section("layers")
        self._collector.forward_order[:] = [
            name for name in state_dict.get("forward_order", []) if name in registered
        ]

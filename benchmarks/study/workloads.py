"""The study's two workloads as declared: flags, budgets, targets and search spaces.

Images: :mod:`study.images`. Text (revision 3, :mod:`study.text_r3`): AdamW, Muon and
SOAP (heavyball, when it imports) as baselines that set the target, and the K-FAC
optimizers ``kfac-muon`` and ``kfac-eigen-adam`` when ``spdkfac train`` has them
(revisions 1 and 2: SPD-KFAC preconditioning AdamW).
``--smoke`` swaps in tiny models and budgets with the same shape, for tests and pilots.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from study.declared import MACHINE_NOTE, TEXT_CHANGES
from study.dimensions import (
    ADAMW_DECAY,
    ADAMW_LR,
    COMMON,
    SCHEDULE,
    SCHEDULE_R2,
    near,
    near_damping,
    space,
)
from study.images import IMAGE_REVISION, fashion
from study.protocol import Choice, Dimension, LogUniform, SearchSpace, StudyPlan, Workload
from study.text_r3 import text_r3
from study.text_r4 import text_r4

__all__ = ["build_plan"]

#: Text, revision 1's chosen configurations (its report): revision 2 tunes around them.
TEXT_FIRST_STAGE = {
    "adamw": {"lr": 0.00266, "weight_decay": 0.00409},
    "muon": {"lr": 0.00685, "weight_decay": 0.0459},
    "soap": {"lr": 0.00609, "weight_decay": 0.124},
    "kfac-adamw": {"lr": 0.00232, "weight_decay": 0.00647, "damping": 0.0531},
}


def _text_dimensions(optimizer: str, revision: int) -> dict[str, Dimension]:
    """Revision 1: the wide ranges; revision 2: within 3x of revision 1's choice."""
    best = TEXT_FIRST_STAGE[optimizer]
    refresh = (Choice((1, 5, 10)), Choice((10, 25, 50)))
    if revision >= 2:
        return space(*near(best), SCHEDULE_R2, near_damping(best, *refresh))
    kfac = (LogUniform(1e-3, 0.1), *refresh) if "damping" in best else None
    return space(ADAMW_LR, ADAMW_DECAY, SCHEDULE, kfac)


def _spaces_text(soap: bool, revision: int) -> dict[str, SearchSpace]:
    fixed = {
        "adamw": ("--optimizer", "adamw"),
        "muon": ("--optimizer", "muon", "--momentum", "0.95"),
        "soap": ("--optimizer", "soap"),
        "kfac-adamw": ("--optimizer", "kfac-adamw", "--strategy", "spd-kfac"),
    }
    return {
        name: SearchSpace(flags, _text_dimensions(name, revision))
        for name, flags in fixed.items()
        if soap or name != "soap"
    }


def _text(smoke: bool, data: str | None, soap: bool, revision: int = 3) -> Workload:
    if revision >= 3:
        return text_r3(smoke, data, soap)
    data_flags = () if data is None else ("--data", data)
    if smoke:
        flags = (
            "--model",
            "gpt",
            "--dataset",
            "text",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--gpt-layers",
            "1",
            "--gpt-heads",
            "2",
            "--gpt-dim",
            "32",
            *data_flags,
            *COMMON,
        )
        budget, every = 8, "4"
        description = "SMOKE: a 1-block width-32 GPT, context 32, batch 8 per worker, 8 steps"
    else:
        flags = ("--model", "gpt", "--dataset", "text", "--batch-size", "16", *data_flags, *COMMON)
        budget, every = 600, "25"
        description = (
            "The built-in GPT (2 blocks, width 128, 4 heads, context 128) on the fortunes "
            "corpus, batch 16 per worker, at most 600 steps"
        )
    return Workload(
        name="text",
        description=description,
        flags=flags,
        budget=budget,
        unit="steps",
        tune_flags=("--val-split", "0.05", "--eval-every", every),
        final_flags=("--eval-every", every),
        tune_metric="val_bits_per_byte",
        final_metric="val_bits_per_byte",
        higher_is_better=False,
        targets=(),
        labels=("",),
        reference="adamw",
        kfac=("kfac-adamw",),
        spaces=_spaces_text(soap, revision),
        revision=revision,
        changes="" if revision == 1 else TEXT_CHANGES,
    )


NO_SOAP = "soap: left out, the heavyball package is not installed"


def build_plan(
    *,
    smoke: bool = False,
    workloads: tuple[str, ...] = ("fashion-mnist", "text"),
    optimizers: tuple[str, ...] | None = None,
    trials: int = 6,
    seeds: tuple[int, ...] = (1, 2, 3),
    workers: int = 2,
    fashion_data: str | None = None,
    text_data: str | None = None,
    text_revision: int = 4,
) -> StudyPlan:
    """The study's plan; ``optimizers`` (None: all) restricts every workload's set but
    the steps-scored ones (text revision 4: its phases need every row). ``text_revision``
    3 plans the retired revision 3 as current (the tests of its protocol).

    Raises:
        ValueError: An unknown workload or optimizer, or a restriction that drops the
            optimizer whose best configuration sets a workload's target (text: adamw).
    """
    # find_spec, not an import: importing heavyball takes seconds, and a broken install
    # shows as failed SOAP trials with their error in the report.
    soap = importlib.util.find_spec("heavyball") is not None
    notes = (MACHINE_NOTE,) + (() if soap else (NO_SOAP,))
    known = {"fashion-mnist": fashion(smoke, fashion_data), "text": _text(smoke, text_data, soap)}
    steps = ()
    if text_revision >= 4 and "text" in workloads:
        steps = (text_r4(smoke, text_data),)
        workloads = tuple(name for name in workloads if name != "text")
    unknown = sorted(set(workloads) - set(known))
    if unknown:
        raise ValueError(
            f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    every = {name for workload in known.values() for name in workload.spaces}
    unknown = sorted(set(optimizers or ()) - every)
    if unknown:
        raise ValueError(
            f"unknown optimizer(s) {', '.join(unknown)}; choose from {', '.join(sorted(every))}"
        )
    chosen = [
        known[name] if optimizers is None else _restrict(known[name], optimizers)
        for name in workloads
    ]
    steps_retired = [_text(smoke, text_data, soap)] if steps else []
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    # Earlier revisions stay in the report: their trials ran before the workload was
    # revised (study.images, TEXT_CHANGES, TEXT_CHANGES_R3).
    earlier = {
        "fashion-mnist": [fashion(smoke, fashion_data, r) for r in range(1, IMAGE_REVISION)],
        # Revisions 1 and 2 read the fortunes corpus: --text-data names revision 3's file.
        "text": [_text(smoke, None, soap, revision=r) for r in (1, 2)],
    }
    retired = tuple(
        workload if optimizers is None else _restrict(workload, optimizers)
        for name in (*workloads, *(["text"] if steps else []))
        for workload in earlier[name]
    ) + tuple(steps_retired)
    return StudyPlan(
        tuple(chosen),
        trials,
        tuple(seeds),
        workers=workers,
        smoke=smoke,
        notes=notes,
        retired=retired,
        steps=steps,
    )


def _restrict(workload: Workload, optimizers: tuple[str, ...]) -> Workload:
    spaces = {name: space for name, space in workload.spaces.items() if name in optimizers}
    if workload.reference is not None and workload.reference not in spaces:
        raise ValueError(
            f"workload {workload.name} needs {workload.reference}: its best configuration "
            "sets the target"
        )
    restricted = replace(workload, spaces=spaces)
    if workload.target_setting and not restricted.baselines:
        raise ValueError(
            f"workload {workload.name} needs a baseline ({', '.join(workload.baselines)}): "
            "their target-setting runs set the target"
        )
    return restricted

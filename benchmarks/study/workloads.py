"""The study's two workloads as declared: flags, budgets, targets and search spaces.

Images: SGD with Nesterov momentum, AdamW, and SPD-KFAC preconditioning SGD (Nesterov
too). Text (revision 3): AdamW, Muon and SOAP (heavyball, when it imports) as baselines
that set the target, and the K-FAC optimizers ``kfac-muon`` and ``kfac-eigen-adam`` when
``spdkfac train`` has them (revisions 1 and 2: SPD-KFAC preconditioning AdamW).
``--smoke`` swaps in tiny models and budgets with the same shape, for tests and pilots.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from study.declared import (
    IMAGE_CHANGES,
    IMAGE_CHANGES_R3,
    IMAGE_FACTOR_EXAMPLES,
    MACHINE_NOTE,
    TEXT_CHANGES,
)
from study.dimensions import (
    ADAMW_DECAY,
    ADAMW_LR,
    COMMON,
    IMAGE_DECAY,
    SCHEDULE,
    SCHEDULE_R2,
    SGD_LR,
    WARMUP,
)
from study.protocol import Choice, Dimension, LogUniform, SearchSpace, StudyPlan, Workload
from study.text_r3 import text_r3

__all__ = ["build_plan"]

#: Images, revision 2's chosen configurations (its report): revision 3 tunes around them.
IMAGE_SECOND_STAGE = {
    "sgd": {"lr": 0.322, "weight_decay": 0.000531, "schedule": 0.8},
    "adamw": {"lr": 0.003, "weight_decay": 0.02, "schedule": 0.6},
    "kfac": {"lr": 0.0284, "weight_decay": 0.000138, "schedule": 0.5, "damping": 0.0613},
}
#: Revision 3's tuning targets lie this far above the test targets (the median gap below).
IMAGE_TUNE_MARGIN = 0.005
#: Text, revision 1's chosen configurations (its report): revision 2 tunes around them.
TEXT_FIRST_STAGE = {
    "adamw": {"lr": 0.00266, "weight_decay": 0.00409},
    "muon": {"lr": 0.00685, "weight_decay": 0.0459},
    "soap": {"lr": 0.00609, "weight_decay": 0.124},
    "kfac-adamw": {"lr": 0.00232, "weight_decay": 0.00647, "damping": 0.0531},
}


def _spaces_images(revision: int) -> dict[str, SearchSpace]:
    momentum = ("--momentum", "0.9", "--nesterov")
    examples = () if revision == 1 else ("--factor-examples", str(IMAGE_FACTOR_EXAMPLES))
    fixed = {
        "sgd": ("--optimizer", "sgd", *momentum),
        "adamw": ("--optimizer", "adamw"),
        "kfac": ("--optimizer", "kfac", "--strategy", "spd-kfac", *momentum, *examples),
    }
    if revision >= 3:
        dimensions = {name: _image_second_stage(name) for name in fixed}
    else:
        dimensions = _image_first_stage(revision)
    return {name: SearchSpace(flags, dimensions[name]) for name, flags in fixed.items()}


def _image_first_stage(revision: int) -> dict[str, dict[str, Dimension]]:
    """Revisions 1 and 2: wide ranges (revision 2: shorter schedules allowed)."""
    schedule = SCHEDULE if revision == 1 else SCHEDULE_R2
    kfac = (LogUniform(1e-3, 0.3), Choice((1, 5, 10)), Choice((10, 25, 50, 100)))
    return {
        "sgd": _space(SGD_LR, IMAGE_DECAY, schedule),
        "adamw": _space(ADAMW_LR, ADAMW_DECAY, schedule),
        "kfac": _space(SGD_LR, IMAGE_DECAY, schedule, kfac),
    }


def _image_second_stage(optimizer: str) -> dict[str, Dimension]:
    """Revision 3: around revision 2's choice (IMAGE_SECOND_STAGE)."""
    best = IMAGE_SECOND_STAGE[optimizer]
    schedule = _neighbours(best["schedule"], SCHEDULE_R2.values)
    kfac = _near_damping(best, Choice((5, 10)), Choice((25, 50, 100)))
    return _space(*_near(best), schedule, kfac)


#: K-FAC's damping, factor update interval and inverse update interval.
KFACDimensions = tuple[Dimension, Choice, Choice]


def _space(
    lr: Dimension, weight_decay: Dimension, schedule: Choice, kfac: KFACDimensions | None = None
) -> dict[str, Dimension]:
    """One optimizer's dimensions (K-FAC's add its damping and refresh intervals)."""
    dimensions: dict[str, Dimension] = {
        "lr": lr,
        "weight_decay": weight_decay,
        "schedule": schedule,
        "warmup": WARMUP,
    }
    if kfac is not None:
        damping, factor_steps, inv_steps = kfac
        dimensions |= {
            "damping": damping,
            "factor_update_steps": factor_steps,
            "inv_update_steps": inv_steps,
        }
    return dimensions


def _near(best: dict[str, float]) -> tuple[LogUniform, LogUniform]:
    """Learning rate and weight decay within 3x of an earlier choice."""
    return _around(best["lr"]), _around(best["weight_decay"])


def _near_damping(best: dict[str, float], *refresh: Choice) -> KFACDimensions | None:
    """K-FAC's damping within 3x of an earlier choice and ``refresh`` (None: not K-FAC)."""
    if "damping" not in best:
        return None
    factor_steps, inv_steps = refresh
    return _around(best["damping"]), factor_steps, inv_steps


def _neighbours(value: float, grid: tuple[float, ...], reach: int = 2) -> Choice:
    """``value`` and up to ``reach`` values of ``grid`` either side of it."""
    index = grid.index(value)
    return Choice(grid[max(0, index - reach) : index + reach + 1])


def _around(value: float) -> LogUniform:
    return LogUniform(float(f"{value / 3:.3g}"), float(f"{value * 3:.3g}"))


def _text_dimensions(optimizer: str, revision: int) -> dict[str, Dimension]:
    """Revision 1: the wide ranges; revision 2: within 3x of revision 1's choice."""
    best = TEXT_FIRST_STAGE[optimizer]
    refresh = (Choice((1, 5, 10)), Choice((10, 25, 50)))
    if revision >= 2:
        return _space(*_near(best), SCHEDULE_R2, _near_damping(best, *refresh))
    kfac = (LogUniform(1e-3, 0.1), *refresh) if "damping" in best else None
    return _space(ADAMW_LR, ADAMW_DECAY, SCHEDULE, kfac)


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


def _fashion(smoke: bool, data: str | None, revision: int = 3) -> Workload:
    data_flags = () if data is None else ("--data", data)
    if smoke:
        flags = (
            "--model",
            "cnn",
            "--dataset",
            "fashion-mnist",
            "--batch-size",
            "32",
            "--train-limit",
            "512",
            *data_flags,
            *COMMON,
        )
        budget, targets, per_epoch = 1, (0.6, 0.7), "2"
        description = "SMOKE: cnn on 512 Fashion-MNIST images, batch 32 per worker, 1 epoch"
    else:
        flags = (
            "--model",
            "resnet20",
            "--dataset",
            "fashion-mnist",
            "--batch-size",
            "128",
            *data_flags,
            *COMMON,
        )
        budget, targets, per_epoch = 10, (0.92, 0.93), "4"
        description = "ResNet-20 on Fashion-MNIST, batch 128 per worker, at most 10 epochs"
    return Workload(
        name="fashion-mnist",
        description=description,
        flags=flags,
        budget=budget,
        unit="epochs",
        tune_flags=("--val-split", "0.1", "--evals-per-epoch", per_epoch),
        final_flags=("--evals-per-epoch", per_epoch),
        tune_metric="val_accuracy",
        final_metric="test_accuracy",
        higher_is_better=True,
        targets=targets,
        labels=tuple(f"{t:.0%}" for t in targets),
        reference=None,
        kfac=("kfac",),
        spaces=_spaces_images(revision),
        revision=revision,
        changes={1: "", 2: IMAGE_CHANGES, 3: IMAGE_CHANGES_R3}[revision],
        tune_margin=IMAGE_TUNE_MARGIN if revision >= 3 else 0.0,
    )


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
) -> StudyPlan:
    """The study's plan; ``optimizers`` (None: all) restricts every workload's set.

    Raises:
        ValueError: An unknown workload or optimizer, or a restriction that drops the
            optimizer whose best configuration sets a workload's target (text: adamw).
    """
    # find_spec, not an import: importing heavyball takes seconds, and a broken install
    # shows as failed SOAP trials with their error in the report.
    soap = importlib.util.find_spec("heavyball") is not None
    notes = (MACHINE_NOTE,) + (() if soap else (NO_SOAP,))
    known = {"fashion-mnist": _fashion(smoke, fashion_data), "text": _text(smoke, text_data, soap)}
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
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    # Earlier revisions stay in the report: their trials ran before the workload was
    # revised (IMAGE_CHANGES, IMAGE_CHANGES_R3, TEXT_CHANGES, TEXT_CHANGES_R3).
    earlier = {
        "fashion-mnist": [_fashion(smoke, fashion_data, revision=r) for r in (1, 2)],
        # Revisions 1 and 2 read the fortunes corpus: --text-data names revision 3's file.
        "text": [_text(smoke, None, soap, revision=r) for r in (1, 2)],
    }
    retired = tuple(
        workload if optimizers is None else _restrict(workload, optimizers)
        for name in workloads
        for workload in earlier[name]
    )
    return StudyPlan(
        tuple(chosen),
        trials,
        tuple(seeds),
        workers=workers,
        smoke=smoke,
        notes=notes,
        retired=retired,
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

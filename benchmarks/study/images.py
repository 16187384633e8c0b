"""The image workload, every revision: ResNet-20 on Fashion-MNIST, SGD with Nesterov
momentum, AdamW, and SPD-KFAC preconditioning SGD (Nesterov too).

Revisions 1 and 2 searched wide ranges; each later one is a tuning stage centred on the
previous revision's choices (:data:`IMAGE_STAGES`). Revision 4 (issue 42) also searches
K-FAC's forms and options (:data:`IMAGE_R4_KFAC`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from study.declared import (
    IMAGE_CHANGES,
    IMAGE_CHANGES_R3,
    IMAGE_CHANGES_R4,
    IMAGE_FACTOR_EXAMPLES,
    IMAGE_R4_PILOTS,
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
    WARMUP_R4,
    around,
    near,
    neighbours,
    space,
)
from study.protocol import Choice, Dimension, LogUniform, SearchSpace, Workload

__all__ = ["IMAGE_REVISION", "IMAGE_STAGES", "ImageStage", "fashion"]

#: The image workload's current revision (earlier ones are retired).
IMAGE_REVISION = 4


@dataclass(frozen=True)
class ImageStage:
    """A later tuning stage of the image workload: the choices it is centred on (learning
    rate, weight decay and K-FAC's damping within 3x of them, the schedule within two
    lengths), K-FAC's factor and inverse refresh intervals, the warm-ups, the dimensions
    K-FAC's space adds, the tuning trials per optimizer (None: the study's number) and what
    the pilots before it tried."""

    centre: dict[str, dict[str, float]]
    factor_steps: Choice
    inv_steps: Choice
    warmup: Choice
    kfac: Mapping[str, Dimension] = field(default_factory=dict)
    trials: int | None = None
    pilots: str = ""


#: Images, revision 4: what K-FAC's space adds (IMAGE_CHANGES_R4 says why).
IMAGE_R4_KFAC: dict[str, Dimension] = {
    "weight_sharing": Choice(("expand", "reduce")),
    "factor_examples": Choice((16, 32)),
}
#: Images, each later tuning stage: revision 3 around revision 2's choices, revision 4
#: around revision 3's (their reports), refresh intervals widened where revision 3 chose a
#: bound (inverses every 100 steps).
IMAGE_STAGES: dict[int, ImageStage] = {
    3: ImageStage(
        centre={
            "sgd": {"lr": 0.322, "weight_decay": 0.000531, "schedule": 0.8},
            "adamw": {"lr": 0.003, "weight_decay": 0.02, "schedule": 0.6},
            "kfac": {"lr": 0.0284, "weight_decay": 0.000138, "schedule": 0.5, "damping": 0.0613},
        },
        factor_steps=Choice((5, 10)),
        inv_steps=Choice((25, 50, 100)),
        warmup=WARMUP,
    ),
    4: ImageStage(
        centre={
            "sgd": {"lr": 0.219, "weight_decay": 0.000553, "schedule": 1.0},
            "adamw": {"lr": 0.00538, "weight_decay": 0.023, "schedule": 0.8},
            "kfac": {"lr": 0.0807, "weight_decay": 0.000317, "schedule": 0.6, "damping": 0.09},
            # New: around its pilot run (AdamW's revision-3 rate and decay, K-FAC's schedule).
            "kfac-eigen-adam": {"lr": 0.00538, "weight_decay": 0.023, "schedule": 0.6},
        },
        factor_steps=Choice((2, 5, 10)),
        inv_steps=Choice((50, 100, 200, 400)),
        warmup=WARMUP_R4,
        kfac=IMAGE_R4_KFAC,
        trials=8,
        pilots=IMAGE_R4_PILOTS,
    ),
}
#: Revision 3's tuning targets lie this far above the test targets (the median gap below).
IMAGE_TUNE_MARGIN = 0.005
IMAGE_CHANGES_BY_REVISION = {1: "", 2: IMAGE_CHANGES, 3: IMAGE_CHANGES_R3, 4: IMAGE_CHANGES_R4}


def _rows(revision: int) -> dict[str, tuple[str, ...]]:
    """Each optimizer's fixed flags: SGD and K-FAC with Nesterov momentum, AdamW; from
    revision 4 also K-FAC's eigen-adam form, a whole update (Adam in K-FAC's eigenbases),
    so SGD without momentum and no KL clip."""
    momentum = ("--momentum", "0.9", "--nesterov")
    # Revisions 2 and 3 fix K-FAC's factor examples; revision 4 searches them.
    examples = ("--factor-examples", str(IMAGE_FACTOR_EXAMPLES)) if revision in (2, 3) else ()
    kfac = ("--optimizer", "kfac", "--strategy", "spd-kfac")
    rows = {
        "sgd": ("--optimizer", "sgd", *momentum),
        "adamw": ("--optimizer", "adamw"),
        "kfac": (*kfac, *momentum, *examples),
    }
    if revision >= 4:
        rows["kfac-eigen-adam"] = (
            *kfac, "--inverse-method", "eigen-adam", "--momentum", "0", "--kl-clip", "0"
        )  # fmt: skip
    return rows


def _kfac_rows(revision: int) -> tuple[str, ...]:
    return tuple(name for name in _rows(revision) if name.startswith("kfac"))


def _spaces(revision: int) -> dict[str, SearchSpace]:
    rows, kfac = _rows(revision), _kfac_rows(revision)
    if revision >= 3:
        stage = IMAGE_STAGES[revision]
        dimensions = {name: _stage(name, stage, name in kfac) for name in rows}
    else:
        dimensions = _first_stage(revision)
    return {name: SearchSpace(flags, dimensions[name]) for name, flags in rows.items()}


def _first_stage(revision: int) -> dict[str, dict[str, Dimension]]:
    """Revisions 1 and 2: wide ranges (revision 2: shorter schedules allowed)."""
    schedule = SCHEDULE if revision == 1 else SCHEDULE_R2
    kfac = (LogUniform(1e-3, 0.3), Choice((1, 5, 10)), Choice((10, 25, 50, 100)))
    return {
        "sgd": space(SGD_LR, IMAGE_DECAY, schedule),
        "adamw": space(ADAMW_LR, ADAMW_DECAY, schedule),
        "kfac": space(SGD_LR, IMAGE_DECAY, schedule, kfac),
    }


def _stage(optimizer: str, stage: ImageStage, kfac: bool) -> dict[str, Dimension]:
    """Revisions 3 and up: around the previous revision's choice; a K-FAC row adds its
    damping (when it has one), refresh intervals and the stage's K-FAC dimensions."""
    best = stage.centre[optimizer]
    schedule = neighbours(best["schedule"], SCHEDULE_R2.values)
    dimensions = space(*near(best), schedule, warmup=stage.warmup)
    if "damping" in best:
        dimensions["damping"] = around(best["damping"])
    if kfac:
        dimensions |= {
            "factor_update_steps": stage.factor_steps,
            "inv_update_steps": stage.inv_steps,
            **stage.kfac,
        }
    return dimensions


def fashion(smoke: bool, data: str | None, revision: int = IMAGE_REVISION) -> Workload:
    """The image workload's ``revision`` (``smoke``: a small CNN on 512 images)."""
    data_flags = () if data is None else ("--data", data)
    if smoke:
        model = ("--model", "cnn", "--dataset", "fashion-mnist", "--batch-size", "32")
        flags = (*model, "--train-limit", "512", *data_flags, *COMMON)
        budget, targets, per_epoch = 1, (0.6, 0.7), "2"
        description = "SMOKE: cnn on 512 Fashion-MNIST images, batch 32 per worker, 1 epoch"
    else:
        model = ("--model", "resnet20", "--dataset", "fashion-mnist", "--batch-size", "128")
        flags = (*model, *data_flags, *COMMON)
        budget, targets, per_epoch = 10, (0.92, 0.93), "4"
        description = "ResNet-20 on Fashion-MNIST, batch 128 per worker, at most 10 epochs"
    stage = IMAGE_STAGES.get(revision)
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
        kfac=_kfac_rows(revision),
        spaces=_spaces(revision),
        revision=revision,
        changes=IMAGE_CHANGES_BY_REVISION[revision],
        tune_margin=IMAGE_TUNE_MARGIN if revision >= 3 else 0.0,
        trials=None if smoke or stage is None else stage.trials,
        pilots="" if stage is None else stage.pilots,
    )

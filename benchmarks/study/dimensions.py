"""The search dimensions and flags the workloads share, and the rules later tuning stages
build their ranges by (within 3x of an earlier choice, neighbouring schedule lengths)."""

from __future__ import annotations

from study.protocol import Choice, Dimension, LogUniform

__all__ = [
    "ADAMW_DECAY",
    "ADAMW_LR",
    "COMMON",
    "IMAGE_DECAY",
    "SCHEDULE",
    "SCHEDULE_R2",
    "SGD_LR",
    "WARMUP",
    "WARMUP_R4",
    "KFACDimensions",
    "around",
    "near",
    "near_damping",
    "neighbours",
    "space",
]

SCHEDULE = Choice((0.6, 0.8, 1.0))
#: Revision 2 of both workloads: schedules of 30 % to all of the budget.
SCHEDULE_R2 = Choice((0.3, 0.4, 0.5, 0.6, 0.8, 1.0))
WARMUP = Choice((0.0, 0.05, 0.1))
#: Images, revision 4: revision 3 chose SGD's longest warm-up (0.1), so 0.2 is offered too.
WARMUP_R4 = Choice((0.0, 0.05, 0.1, 0.2))
SGD_LR = LogUniform(0.02, 0.8)
IMAGE_DECAY = LogUniform(5e-5, 2e-3)
ADAMW_LR = LogUniform(3e-4, 1e-2)
ADAMW_DECAY = LogUniform(1e-3, 0.3)
COMMON = ("--no-tensorboard", "--threads", "1", "--lr-schedule", "cosine")

#: K-FAC's damping, factor update interval and inverse update interval.
KFACDimensions = tuple[Dimension, Choice, Choice]


def space(
    lr: Dimension,
    weight_decay: Dimension,
    schedule: Choice,
    kfac: KFACDimensions | None = None,
    *,
    warmup: Choice = WARMUP,
) -> dict[str, Dimension]:
    """One optimizer's dimensions (K-FAC's add its damping and refresh intervals)."""
    dimensions: dict[str, Dimension] = {
        "lr": lr,
        "weight_decay": weight_decay,
        "schedule": schedule,
        "warmup": warmup,
    }
    if kfac is not None:
        damping, factor_steps, inv_steps = kfac
        dimensions |= {
            "damping": damping,
            "factor_update_steps": factor_steps,
            "inv_update_steps": inv_steps,
        }
    return dimensions


def near(best: dict[str, float]) -> tuple[LogUniform, LogUniform]:
    """Learning rate and weight decay within 3x of an earlier choice."""
    return around(best["lr"]), around(best["weight_decay"])


def near_damping(best: dict[str, float], *refresh: Choice) -> KFACDimensions | None:
    """K-FAC's damping within 3x of an earlier choice and ``refresh`` (None: not K-FAC)."""
    if "damping" not in best:
        return None
    factor_steps, inv_steps = refresh
    return around(best["damping"]), factor_steps, inv_steps


def neighbours(value: float, grid: tuple[float, ...], reach: int = 2) -> Choice:
    """``value`` and up to ``reach`` values of ``grid`` either side of it."""
    index = grid.index(value)
    return Choice(grid[max(0, index - reach) : index + reach + 1])


def around(value: float) -> LogUniform:
    """Log-uniform within a factor of 3 of ``value`` (bounds to 3 significant digits)."""
    return LogUniform(float(f"{value / 3:.3g}"), float(f"{value * 3:.3g}"))

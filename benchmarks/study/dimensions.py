"""The search dimensions and flags the workloads share."""

from __future__ import annotations

from study.protocol import Choice, LogUniform

__all__ = [
    "ADAMW_DECAY",
    "ADAMW_LR",
    "COMMON",
    "IMAGE_DECAY",
    "SCHEDULE",
    "SCHEDULE_R2",
    "SGD_LR",
    "WARMUP",
]

SCHEDULE = Choice((0.6, 0.8, 1.0))
#: Revision 2 of both workloads: schedules of 30 % to all of the budget.
SCHEDULE_R2 = Choice((0.3, 0.4, 0.5, 0.6, 0.8, 1.0))
WARMUP = Choice((0.0, 0.05, 0.1))
SGD_LR = LogUniform(0.02, 0.8)
IMAGE_DECAY = LogUniform(5e-5, 2e-3)
ADAMW_LR = LogUniform(3e-4, 1e-2)
ADAMW_DECAY = LogUniform(1e-3, 0.3)
COMMON = ("--no-tensorboard", "--threads", "1", "--lr-schedule", "cosine")

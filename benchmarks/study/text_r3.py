"""The text workload's revision 3: a 4-block GPT on GCIDE, every optimizer searched the
same way (AdamW adds beta2), the target set by the best baseline over the whole budget
(AlgoPerf's rule), and the K-FAC rows ``spdkfac train`` has."""

from __future__ import annotations

from spdkfac.training.config import OPTIMIZERS
from study.declared import TEXT_CHANGES_R3, TEXT_R3_PILOTS
from study.dimensions import ADAMW_DECAY, COMMON, SCHEDULE_R2, WARMUP
from study.protocol import Choice, Dimension, LogUniform, SearchSpace, Workload

__all__ = ["TEXT_R3_COMMON", "TEXT_R3_KFAC", "text_r3"]

#: Text revision 3: every optimizer's learning rate, weight decay, schedule, warm-up and
#: gradient clipping (0: none) are drawn from the same ranges.
TEXT_R3_COMMON: dict[str, Dimension] = {
    "lr": LogUniform(3e-4, 3e-2),
    "weight_decay": ADAMW_DECAY,
    "schedule": SCHEDULE_R2,
    "warmup": WARMUP,
    "grad_clip": Choice((0.0, 1.0)),
}
#: The K-FAC rows of text revision 3: fixed flags and their own dimensions. A row is in the
#: plan when ``spdkfac train --optimizer`` has its name.
TEXT_R3_KFAC: dict[str, tuple[tuple[str, ...], dict[str, Dimension]]] = {
    "kfac-muon": (
        ("--optimizer", "kfac-muon", "--strategy", "spd-kfac", "--momentum", "0.95"),
        {
            "damping": LogUniform(1e-3, 1.0),  # relative to A's mean eigenvalue
            "factor_update_steps": Choice((1, 5, 10)),
            "inv_update_steps": Choice((10, 25, 50)),
        },
    ),
    "kfac-eigen-adam": (
        ("--optimizer", "kfac-eigen-adam", "--strategy", "spd-kfac"),
        {
            "factor_update_steps": Choice((1, 5, 10)),
            "inv_update_steps": Choice((10, 25, 50)),  # SOAP's precondition frequency
        },
    ),
}


def _spaces_text_r3(soap: bool) -> dict[str, SearchSpace]:
    """Revision 3: the same wide ranges for every optimizer; AdamW adds beta2."""
    spaces = {
        "adamw": SearchSpace(
            ("--optimizer", "adamw"),
            {**TEXT_R3_COMMON, "beta2": Choice((0.95, 0.99, 0.999))},
        ),
        "muon": SearchSpace(("--optimizer", "muon", "--momentum", "0.95"), TEXT_R3_COMMON),
    }
    if soap:
        spaces["soap"] = SearchSpace(("--optimizer", "soap"), TEXT_R3_COMMON)
    for name, (fixed, own) in TEXT_R3_KFAC.items():
        if name in OPTIMIZERS:
            spaces[name] = SearchSpace(fixed, {**TEXT_R3_COMMON, **own})
    return spaces


#: Text revision 3: the GPT's shape, the batch per worker, the budget and the evaluation
#: interval, in steps (see TEXT_CHANGES_R3 for the step time they were chosen on).
TEXT_R3_MODEL = ("--gpt-layers", "4", "--gpt-dim", "128", "--gpt-heads", "4", "--seq-len", "128")
TEXT_R3_BATCH, TEXT_R3_STEPS, TEXT_R3_EVERY = 16, 1500, 50


def text_r3(smoke: bool, data: str | None, soap: bool) -> Workload:
    """Revision 3: a 4-block GPT on GCIDE, baselines tuned with the usual recipe, the
    target set by the best baseline over the whole budget."""
    data_flags = () if data is None else ("--data", data)
    if smoke:
        model = ("--gpt-layers", "1", "--gpt-dim", "32", "--gpt-heads", "2", "--seq-len", "32")
        batch, budget, every, held_out = 8, 8, 4, "0.05"
        description = "SMOKE: a 1-block width-32 GPT on GCIDE, context 32, batch 8 per worker"
    else:
        model, batch, budget, every = TEXT_R3_MODEL, TEXT_R3_BATCH, TEXT_R3_STEPS, TEXT_R3_EVERY
        held_out = "0.005"  # about 142 KB, as much as the validation split
        description = (
            "The built-in GPT (4 blocks, width 128, 4 heads, context 128) on the GCIDE "
            f"dictionary (`--dataset gcide`), batch {batch} per worker, at most {budget} steps"
        )
    return Workload(
        name="text",
        description=description,
        flags=(
            "--model",
            "gpt",
            "--dataset",
            "gcide",
            "--batch-size",
            str(batch),
            *model,
            *data_flags,
            *COMMON,
        ),
        budget=budget,
        unit="steps",
        tune_flags=("--val-split", held_out, "--eval-every", str(every)),
        final_flags=("--eval-every", str(every)),
        tune_metric="val_bits_per_byte",
        final_metric="val_bits_per_byte",
        higher_is_better=False,
        targets=(),
        labels=("",),
        reference=None,
        kfac=tuple(TEXT_R3_KFAC),
        spaces=_spaces_text_r3(soap),
        revision=3,
        changes=TEXT_CHANGES_R3,
        trials=None if smoke else 8,
        target_setting=True,
        pilots=TEXT_R3_PILOTS,
    )

"""The text workload's revision 4: scored in steps to a target by AlgoPerf's rules, on a GPT
sized so that a run reads at least 12 bytes of text per parameter (see TEXT_CHANGES_R4)."""

from __future__ import annotations

from study.declared import TEXT_CHANGES_R4
from study.dimensions import COMMON
from study.protocol import Choice, Dimension, LogUniform, SearchSpace
from study.steps import StepsWorkload

__all__ = ["TEXT_R4_BUDGET", "TEXT_R4_MODEL", "text_r4"]

#: The GPT: 4 blocks of width 96 (4 heads), context 128: 484,416 parameters.
TEXT_R4_MODEL = ("--gpt-layers", "4", "--gpt-dim", "96", "--gpt-heads", "4", "--seq-len", "128")
#: One process, 64 windows of 128 bytes per step (8,192 bytes: 2x revision 3's 4,096).
TEXT_R4_BATCH = 64
#: The target-setting budget: 720 steps x 8,192 bytes = 5.9 MB, 12.2 bytes per parameter.
TEXT_R4_BUDGET = 720
#: The validation split: the 0.2 % of GCIDE after the training text (about 58 KB), the
#: one split tuning and scoring read.
TEXT_R4_VALIDATION = "0.002"

WARMUP = Choice((0.05, 0.1))
#: Muon and the K-FAC rows that end in Muon's orthogonalization search one range: within
#: 3x of the geometric mean of revision 3's Muon (0.00355) and K-FAC-Muon (0.0108) choices.
MUON_LR = LogUniform(0.00206, 0.0186)
#: Every AdamW part (AdamW itself, and the embeddings, head, norms and biases of the Muon
#: and K-FAC rows) with beta2 0.95, the usual language-model recipe.
BETA2 = ("--beta2", "0.95")


def _row(fixed: str, **dimensions: Dimension) -> SearchSpace:
    """A row: its fixed flags (with :data:`BETA2` where ``{beta2}`` stands) and its
    dimensions after the learning rate and warm-up every row searches."""
    flags = tuple(fixed.format(beta2=" ".join(BETA2)).split())
    return SearchSpace(flags, {"lr": dimensions.pop("lr"), "warmup": WARMUP, **dimensions})


def _baselines() -> dict[str, SearchSpace]:
    return {
        "adamw": _row(
            "--optimizer adamw {beta2} --weight-decay 0.1",
            lr=LogUniform(0.00293, 0.0263),  # within 3x of revision 3's 0.00878
        ),
        "muon": _row("--optimizer muon --momentum 0.95 {beta2} --weight-decay 0.01", lr=MUON_LR),
        "soap": _row(
            "--optimizer soap --weight-decay 0.01",
            lr=LogUniform(0.00897, 0.0807),  # within 3x of revision 3's 0.0269
            precondition_frequency=Choice((2, 10)),
        ),
    }


def _candidates() -> dict[str, SearchSpace]:
    """The K-FAC forms the pilots choose two rows among (every one: AdamW on the rest)."""
    refresh = Choice((2, 10))  # inverses (eigenbases) every 2 or 10 steps, as SOAP's
    muon = (
        "--momentum 0.95 {beta2} --weight-decay 0.01 --factor-update-steps 5 --inv-update-steps 50"
    )
    eigen = "{beta2} --weight-decay 0.01 --factor-update-steps 2"
    return {
        "kfac-muon": _row(
            f"--optimizer kfac-muon {muon}",
            lr=MUON_LR,
            damping=LogUniform(0.218, 1.96),  # relative; within 3x of revision 3's 0.654
        ),
        "kfac-eigen-adam": _row(
            f"--optimizer kfac-eigen-adam {eigen}",
            lr=LogUniform(0.000763, 0.00687),  # within 3x of revision 3's 0.00229
            inv_update_steps=refresh,
        ),
        "kfac-eigen-adam-muon": _row(
            f"--optimizer kfac-eigen-adam-muon {eigen}", lr=MUON_LR, inv_update_steps=refresh
        ),
        "kfac-two-sided-muon": _row(
            f"--optimizer kfac-muon --inverse-method cholesky {muon}",
            lr=MUON_LR,
            damping=LogUniform(0.01, 0.3),  # absolute, as two-sided K-FAC's
        ),
    }


def text_r4(smoke: bool, data: str | None) -> StepsWorkload:
    """Revision 4 (``smoke``: a 1-block width-32 GPT and an 8-step budget, same shape)."""
    data_flags = () if data is None else ("--data", data)
    model, batch, budget = TEXT_R4_MODEL, TEXT_R4_BATCH, TEXT_R4_BUDGET
    description = (
        "The built-in GPT (4 blocks, width 96, 4 heads, context 128; 484,416 parameters) on "
        f"the GCIDE dictionary (`--dataset gcide`), one process, batch {batch}, target "
        f"setting over {budget} steps"
    )
    if smoke:
        model = ("--gpt-layers", "1", "--gpt-dim", "32", "--gpt-heads", "2", "--seq-len", "32")
        batch, budget = 8, 8
        description = "SMOKE: a 1-block width-32 GPT on GCIDE, context 32, batch 8"
    flags = ("--model", "gpt", "--dataset", "gcide", "--batch-size", str(batch), *model,
             *data_flags, *COMMON, "--val-split", "0.05" if smoke else TEXT_R4_VALIDATION,
             "--grad-clip", "1", "--decay-scope", "matrices")  # fmt: skip
    return StepsWorkload(
        name="text",
        revision=4,
        description=description,
        flags=flags,
        budget=budget,
        metric="val_bits_per_byte",
        baselines=_baselines(),
        setters=("muon", "soap"),
        setter_trials=1 if smoke else 8,
        setting_seeds=(1, 2, 3) if smoke else (1, 2, 3, 4, 5),
        candidates=_candidates(),
        pilot_trials=1 if smoke else 3,
        kfac_rows=2,
        studies=2 if smoke else 3,
        trials=2 if smoke else 5,
        evaluations=4 if smoke else 50,
        changes=TEXT_CHANGES_R4,
    )

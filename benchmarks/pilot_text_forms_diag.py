"""Pilot round 2 of issue 41's transformer forms (2026-12-03), one process, not study
trials: the revision-3 model (GPT 4 x 128) on dict-gcide, batch 32, 200 steps, cosine over
them. ``VARIANT`` "identity" replaces K-FAC's eigen-bases by the identity in the
``eigen-adam`` form (a control: Adam with SOAP's betas on the hidden layers), "base" runs
the options as given. Prints one ``RESULT`` line: (step, validation bits per byte) and
the median step in ms.

    python benchmarks/pilot_text_forms_diag.py VARIANT --optimizer NAME [spdkfac train flags]
"""

from __future__ import annotations

import json
import sys

import torch

import spdkfac.forms.eigen as eigen
from spdkfac.cli import main

variant, extra = sys.argv[1], sys.argv[2:]
if variant == "identity":
    adam = eigen.EigenAdam._adam

    def identity(self, work, left, right, moments):  # type: ignore[no-untyped-def]
        eye_left = torch.eye(left.shape[0], dtype=left.dtype)
        eye_right = None if right is None else torch.eye(right.shape[0], dtype=right.dtype)
        return adam(self, work, eye_left, eye_right, moments)

    eigen.EigenAdam._adam = identity  # type: ignore[method-assign]
out = f"/tmp/diag-{variant}-{'_'.join(extra)}"
main(["train", "--model", "gpt", "--dataset", "gcide", "--batch-size", "32",
      "--gpt-layers", "4", "--gpt-dim", "128", "--gpt-heads", "4", "--no-tensorboard",
      "--threads", "1", "--lr-schedule", "cosine", "--max-steps", "200",
      "--lr-schedule-steps", "200", "--eval-every", "100", "--overwrite", "--out-dir", out,
      *extra])  # fmt: skip
with open(out + "/summary.json") as file:
    summary = json.load(file)
curve = [(m["step"], round(m["val_bits_per_byte"], 3)) for m in summary["metrics"]]
print("RESULT", variant, extra, curve, round(summary["median_iteration_ms"], 1))

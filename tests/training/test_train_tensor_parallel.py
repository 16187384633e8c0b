"""``spdkfac train --fsdp --tp-size N``: the tiny LLaMA split by its tensor-parallel plan on a
2 × 2 ``(dp, tp)`` mesh trains, checkpoints through DCP and resumes as the uninterrupted
run; with ``--hsdp-replicas 2`` (HSDP × TP on a 2 × 1 × 2 mesh) it trains as that run; what
it does not support exits 2 with one line before any process group."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed_helper import run_distributed, spdkfac_on_rank


def _ranks(*args: str) -> subprocess.CompletedProcess[str]:
    results = run_distributed(
        spdkfac_on_rank, 4, ["train", *args], timeout=240, env={"OMP_NUM_THREADS": "1"}
    )
    assert len({code for code, _, _ in results}) == 1, results
    return subprocess.CompletedProcess(args, *results[0])


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_fsdp_tp_llama_resumes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """World 4 as 2 × 2: 3 steps with a checkpoint every 2, against a resume from its
    step-2 checkpoint to 3; every step's loss and validation loss alike (float tolerance)."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 60)
    common = ["--model", "llama", "--dataset", "text", "--data", str(text), "--seq-len", "8",
              "--gpt-layers", "1", "--gpt-heads", "2", "--gpt-dim", "8", "--batch-size", "4",
              "--epochs", "1", "--eval-every", "1", "--lr", "0.05", "--damping", "0.3",
              "--inv-update-steps", "2", "--checkpoint-every", "2", "--no-tensorboard",
              "--fsdp", "--tp-size", "2"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = _ranks(*common, "--out-dir", str(straight), "--max-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "FSDP2 x TP (2 tensor-parallel ranks per group) on a 2 x 2 mesh" in first.stdout
    # The run as it stood after step 2 (its checkpoint there, ``latest`` naming it).
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000003")
    (resumed / "checkpoints" / "latest").write_text("step-00000002\n")
    for written in ("metrics.csv", "summary.json"):  # the resumed run writes its own
        (resumed / written).unlink()
    rest = _ranks(*common, "--out-dir", str(resumed), "--max-steps", "3", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "at step 2" in rest.stdout
    assert json.loads((resumed / "summary.json").read_text())["replicas_identical"]
    theirs, ours = _rows(straight), _rows(resumed)
    assert len(ours) == len(theirs) == 3
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("train_loss", "val_loss"):
            assert float(mine[key]) == pytest.approx(float(other[key]), rel=1e-5, abs=1e-6), key
    # HSDP x TP on a (2, 1, 2) mesh: the same 2 data-parallel batches, so the same run.
    hsdp = tmp_path / "hsdp"
    third = _ranks(*common, "--hsdp-replicas", "2", "--out-dir", str(hsdp), "--max-steps", "3")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "HSDP (2 replicas) x TP (2 tensor-parallel ranks per group) on a 2 x 1 x 2 mesh" in (
        third.stdout
    )
    for mine, other in zip(_rows(hsdp), theirs, strict=True):
        for key in ("train_loss", "val_loss"):
            assert float(mine[key]) == pytest.approx(float(other[key]), rel=1e-5, abs=1e-6), key


@pytest.mark.usefixtures("here")
@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--fsdp", "--tp-size", "2"], "--tp-size 2 does not divide 1 ranks"),
     (["--tp-size", "2"], "tp_size 2 needs fsdp"),
     (["--fsdp", "--tp-size", "1"], "tp_size must be an int >= 2"),
     (["--fsdp", "--tp-size", "3"], "tp_size 3 must divide gpt_heads (4)"),
     (["--fsdp", "--tp-size", "2", "--model", "gpt"], "model 'gpt' has no tensor-parallel plan")],
)  # fmt: skip
def test_tp_size_refusals(flags: list[str], named: str) -> None:
    """One line, exit 2, no process group: the world, fsdp, the heads, the model."""
    argv = ["train", "--model", "llama", "--dataset", "text", *flags]
    code, _, err = spdkfac_on_rank(0, 1, argv)
    assert not dist.is_initialized()
    assert code == 2, err
    assert named in err.strip().splitlines()[-1], err

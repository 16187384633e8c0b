"""``spdkfac train --fsdp``: a two-rank FSDP2 run trains as the DDP run of the same
config (each step's mean loss and the test accuracy), checkpoints through DCP and resumes as
the uninterrupted run, and the combinations it does not support exit 2 with one line."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed_helper import run_distributed, spdkfac_on_rank


def _ranks(world_size: int, *args: str) -> subprocess.CompletedProcess[str]:
    results = run_distributed(
        spdkfac_on_rank, world_size, ["train", *args], timeout=240, env={"OMP_NUM_THREADS": "1"}
    )
    assert len({code for code, _, _ in results}) == 1, results
    return subprocess.CompletedProcess(args, *results[0])


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize(
    ("model", "optimizer", "extra"),
    [
        ("cnn", "kfac", []),
        ("cnn", "kfac", ["--strategy", "osawa"]),
        ("cnn", "sgd", []),
        ("cnn", "kfac", ["--accumulation-steps", "2"]),
        ("resnet20", "kfac", ["--batchnorm", "unit-wise"]),
    ],
)
def test_two_rank_fsdp_trains_as_ddp(
    tiny_fashion_mnist: Path, tmp_path: Path, model: str, optimizer: str, extra: list[str]
) -> None:
    """Every step's mean loss as under DDP; the test accuracy too where no BatchNorm
    running statistics differ (DDP evaluates with rank 0's, FSDP2 with each rank's own)."""
    kfac = ["--damping", "0.3", "--inv-update-steps", "2"] if optimizer == "kfac" else []
    common = ["--data", str(tiny_fashion_mnist), "--model", model, "--epochs", "1", *extra,
              "--batch-size", "16", "--max-steps", "4", "--eval-every", "1",
              "--optimizer", optimizer, "--lr", "0.05", *kfac, "--no-tensorboard"]  # fmt: skip
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    first = _ranks(2, *common, "--out-dir", str(ddp))
    assert first.returncode == 0, first.stderr[-3000:]
    second = _ranks(2, *common, "--out-dir", str(fsdp), "--fsdp")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "FSDP2" in second.stdout
    assert (fsdp / "checkpoints" / "step-00000004" / ".metadata").is_file()  # DCP, at the end
    theirs, ours = _rows(ddp), _rows(fsdp)
    assert len(ours) == len(theirs) == 4
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("train_loss",) if model == "resnet20" else ("train_loss", "test_accuracy"):
            assert float(mine[key]) == pytest.approx(float(other[key]), rel=1e-5, abs=1e-6), key
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["replicas_identical"]


def test_four_rank_hsdp_trains_as_ddp(tiny_fashion_mnist: Path, tmp_path: Path) -> None:
    """HSDP 2 x 2 (2 replicas of 2 shards) at world 4: every step's loss as under DDP."""
    common = ["--data", str(tiny_fashion_mnist), "--model", "cnn", "--epochs", "1",
              "--batch-size", "16", "--max-steps", "3", "--eval-every", "1",
              "--damping", "0.3", "--inv-update-steps", "2", "--no-tensorboard"]  # fmt: skip
    ddp, hsdp = tmp_path / "ddp", tmp_path / "hsdp"
    first = _ranks(4, *common, "--out-dir", str(ddp))
    assert first.returncode == 0, first.stderr[-3000:]
    second = _ranks(4, *common, "--out-dir", str(hsdp), "--fsdp", "--hsdp-replicas", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "HSDP (2 replicas" in second.stdout
    theirs, ours = _rows(ddp), _rows(hsdp)
    assert len(ours) == len(theirs) == 3
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("train_loss", "test_accuracy"):
            assert float(mine[key]) == pytest.approx(float(other[key]), rel=1e-5, abs=1e-6), key


@pytest.mark.usefixtures("here")
@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--weight-rescaling"], "fsdp does not support weight_rescaling"),
     (["--optimizer", "muon"], "muon"), (["--optimizer", "soap"], "soap"),
     (["--hsdp-replicas", "3"], "--hsdp-replicas 3 does not divide 1 data-parallel ranks")],
)  # fmt: skip
def test_fsdp_refuses_what_it_does_not_support(flags: list[str], named: str) -> None:
    code, _, err = spdkfac_on_rank(0, 1, ["train", "--fsdp", *flags])
    assert not dist.is_initialized()
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert named in last, err


@pytest.mark.usefixtures("here")
def test_hsdp_replicas_needs_fsdp() -> None:
    code, _, err = spdkfac_on_rank(0, 1, ["train", "--hsdp-replicas", "2"])
    assert code == 2, err
    assert "hsdp_replicas needs fsdp" in err.strip().splitlines()[-1], err

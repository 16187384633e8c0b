"""``spdkfac train --fsdp`` with checkpoints: written through DCP (each rank its shards,
atomically, ``latest`` last, retention as without ``--fsdp``) and resumed as the
uninterrupted run at world 2; refused by a run without ``--fsdp``."""

from __future__ import annotations

import csv
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distributed_helper import run_distributed, spdkfac_on_rank


def _ranks(*args: str) -> subprocess.CompletedProcess[str]:
    results = run_distributed(
        spdkfac_on_rank, 2, ["train", *args], timeout=240, env={"OMP_NUM_THREADS": "1"}
    )
    assert len({code for code, _, _ in results}) == 1, results
    return subprocess.CompletedProcess(args, *results[0])


def _losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open() as handle:
        return [float(row["train_loss"]) for row in csv.DictReader(handle)]


def _final_state(out: Path, tmp_path: Path) -> dict[str, Any]:
    """The checkpoint ``latest`` names, whole (DCP's shards put together in one file)."""
    name = (out / "checkpoints" / "latest").read_text().strip()
    whole = tmp_path / f"{out.name}.pt"
    dcp_to_torch_save(out / "checkpoints" / name, whole)
    return dict(torch.load(whole, weights_only=False))


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its dotted path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        found: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            found.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
        return found
    return {}


@pytest.mark.parametrize(
    "extra",
    [["--model", "cnn", "--strategy", "spd-kfac", "--eval-every", "1"],
     ["--model", "cnn", "--strategy", "osawa", "--optimizer", "kfac-adamw", "--eval-every", "1"],
     ["--model", "resnet20", "--batchnorm", "unit-wise", "--batch-size", "8", "--eval-every", "2"]],
    ids=["cnn-spd-kfac-sgd", "cnn-osawa-adamw", "resnet20-batchnorm"],
)  # fmt: skip
def test_fsdp_resume_continues_as_the_uninterrupted_run(
    tiny_fashion_mnist: Path, tmp_path: Path, extra: list[str]
) -> None:
    """4 steps with a checkpoint every 2, against 2 steps then a resume to 4: every step's
    loss, the model, the optimizer and K-FAC in the last checkpoint, and each rank's own
    BatchNorm statistics (FSDP2 leaves them unsynchronized), alike."""
    common = ["--data", str(tiny_fashion_mnist), "--epochs", "1",
              "--batch-size", "16", "--lr", "0.05", "--damping", "0.3",
              "--inv-update-steps", "3", "--checkpoint-every", "2", "--no-tensorboard",
              "--fsdp", *extra]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = _ranks(*common, "--out-dir", str(straight), "--max-steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    half = _ranks(*common, "--out-dir", str(resumed), "--max-steps", "2")
    assert half.returncode == 0, half.stderr[-3000:]
    rest = _ranks(*common, "--out-dir", str(resumed), "--max-steps", "4", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout and "at step 2" in rest.stdout
    checkpoints = straight / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest", "step-00000002", "step-00000004"
    ]  # fmt: skip
    names = {p.name for p in (checkpoints / "step-00000004").iterdir()}
    assert {".metadata", "common.pt", "rank-0.pt", "rank-1.pt"} <= names
    ours, theirs = _losses(resumed), _losses(straight)
    assert len(ours) == len(theirs) == 4 // int(extra[-1])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    mine, other = (
        _tensors(_final_state(resumed, tmp_path)),
        _tensors(_final_state(straight, tmp_path)),
    )
    assert mine.keys() == other.keys()
    assert any(key.startswith("kfac.") for key in mine)
    assert any(key.startswith("optimizer.state.") for key in mine)
    for key in mine:
        torch.testing.assert_close(mine[key], other[key], rtol=1e-5, atol=1e-6, msg=key)
    for rank in (0, 1):
        ours_own, theirs_own = (
            torch.load(out / "checkpoints" / "step-00000004" / f"rank-{rank}.pt")["buffers"]
            for out in (resumed, straight)
        )
        torch.testing.assert_close(ours_own, theirs_own, rtol=1e-5, atol=1e-6)


def test_a_sharded_checkpoint_is_refused_without_fsdp(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    """The layout is part of the configuration: every rank exits 1 with the same line."""
    common = ["--data", str(tiny_fashion_mnist), "--model", "mlp", "--epochs", "1",
              "--batch-size", "16", "--out-dir", str(tmp_path), "--no-tensorboard"]  # fmt: skip
    first = _ranks(*common, "--max-steps", "1", "--fsdp")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _ranks(*common, "--max-steps", "2", "--resume")
    assert again.returncode == 1
    assert "incompatible configuration (differs in fsdp)" in again.stderr.strip().splitlines()[-1]


@pytest.mark.usefixtures("here")
def test_a_two_rank_checkpoint_resumes_on_one_process(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    """DCP reshards: osawa's owners' layers and the model's shards, saved by two ranks, load
    whole on one process (the model unsharded there), which trains on and checkpoints."""
    common = ["--data", str(tiny_fashion_mnist), "--model", "cnn", "--epochs", "1",
              "--batch-size", "16", "--out-dir", str(tmp_path), "--no-tensorboard", "--fsdp",
              "--strategy", "osawa", "--checkpoint-every", "2"]  # fmt: skip
    first = _ranks(*common, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    code, out, err = spdkfac_on_rank(0, 1, ["train", *common, "--max-steps", "3", "--resume"])
    assert code == 0, err[-3000:]
    assert "resuming a 2-rank checkpoint on 1 ranks" in out and "at step 2" in out
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    state = _final_state(tmp_path, tmp_path)
    assert state["kfac"]["layers"] and all(
        torch.isfinite(t).all() for t in _tensors(state["model"]).values()
    )


def test_a_damaged_checkpoint_is_refused_alike_on_every_rank(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    """A flipped byte in a shard, a truncated shard, an emptied shard and a truncated
    ``.metadata``: every rank exits 1 with the same line naming the file, before DCP reads
    anything (no traceback, no hang)."""
    common = ["--data", str(tiny_fashion_mnist), "--model", "mlp", "--epochs", "1",
              "--batch-size", "16", "--no-tensorboard", "--fsdp"]  # fmt: skip
    saved = tmp_path / "saved"
    first = _ranks(*common, "--out-dir", str(saved), "--max-steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    step = saved / "checkpoints" / "step-00000001"
    shards = sorted(path.name for path in step.glob("*.distcp"))
    assert len(shards) == 2, sorted(path.name for path in step.iterdir())
    cases = [(shards[1], "flip", "CRC-32 mismatch"),
             (shards[0], "truncate", "bytes, not the"),
             (shards[1], "empty", "0 bytes, not the"),
             (".metadata", "truncate", "bytes, not the")]  # fmt: skip
    for name, how, message in cases:
        out = tmp_path / f"{how}-{name}"
        shutil.copytree(saved, out)
        target = out / "checkpoints" / "step-00000001" / name
        data = target.read_bytes()
        if how == "flip":
            target.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1])
                               + data[len(data) // 2 + 1 :])  # fmt: skip
        else:
            target.write_bytes(data[: len(data) // 2] if how == "truncate" else b"")
        args = ["train", *common, "--out-dir", str(out), "--max-steps", "2", "--resume"]
        results = run_distributed(
            spdkfac_on_rank, 2, args, timeout=240, env={"OMP_NUM_THREADS": "1"}
        )
        lines = {err.strip().splitlines()[-1] for _, _, err in results}
        assert [code for code, _, _ in results] == [1, 1], results
        assert len(lines) == 1, lines
        (line,) = lines
        assert str(target) in line and message in line, line
        assert all("Traceback" not in err for _, _, err in results)

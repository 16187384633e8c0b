"""One run per output directory: refusing a fresh run in another run's directory,
clearing it on request, bad paths; the decision agreed by every rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed_helper import run_distributed
from spdkfac.comm import LocalCommunicator, init_distributed
from spdkfac.training.outdir import (
    RUN_FILES,
    OutDirError,
    claim_out_dir,
    clear_previous_run,
    previous_run_files,
)


def _previous_run(out: Path) -> None:
    """What a finished run leaves (TensorBoard's directory included)."""
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    (out / "checkpoints" / "step-00000002" / "common.pt").write_bytes(b"x")
    (out / "checkpoints" / "latest").write_text("step-00000002\n")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_bytes(b"x")
    for name in ("config.toml", "metrics.csv", "summary.json"):
        (out / name).write_text("x")


def test_a_fresh_run_in_another_runs_directory_is_refused(tmp_path: Path) -> None:
    comm = LocalCommunicator()
    assert not claim_out_dir(tmp_path / "new", comm, resume=False, overwrite=False)
    (tmp_path / "checkpoints").mkdir()  # empty: nothing to lose
    (tmp_path / "notes.txt").write_text("the user's own")
    assert not claim_out_dir(tmp_path, comm, resume=False, overwrite=False)
    (tmp_path / "metrics.csv").write_text("epoch\n")
    with pytest.raises(OutDirError, match=r"holds another run \(metrics.csv\); pass --resume "
                       r"to continue it, --overwrite to delete it"):  # fmt: skip
        claim_out_dir(tmp_path, comm, resume=False, overwrite=False)
    assert not claim_out_dir(tmp_path, comm, resume=True, overwrite=False)
    assert claim_out_dir(tmp_path, comm, resume=False, overwrite=True)


def test_overwrite_deletes_only_the_previous_runs_files(tmp_path: Path) -> None:
    _previous_run(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own")
    assert previous_run_files(tmp_path) == list(RUN_FILES)
    # What a clearing killed midway left behind goes too.
    (tmp_path / ".spdkfac-overwritten-old").mkdir()
    (tmp_path / ".spdkfac-overwritten-old" / "metrics.csv").write_text("x")
    assert clear_previous_run(tmp_path) == list(RUN_FILES)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    assert not claim_out_dir(tmp_path, LocalCommunicator(), resume=False, overwrite=False)


def test_a_file_is_refused_on_every_rank(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(OutDirError, match="is not a directory"):
        claim_out_dir(file, LocalCommunicator(), resume=False, overwrite=True)


def _claim_where_only_rank_1_sees_a_run(rank: int, world_size: int, root: str) -> str:
    out = Path(root) / f"rank-{rank}"  # as if the ranks did not share a file system
    out.mkdir()
    if rank == 1:
        (out / "summary.json").write_text("{}")
    comm = init_distributed()
    try:
        overwrite = claim_out_dir(out, comm, resume=False, overwrite=True)
        try:
            claim_out_dir(out, comm, resume=False, overwrite=False)
        except OutDirError as error:
            return f"{overwrite} {error}".replace(str(out), "OUT")
        return f"{overwrite} accepted"
    finally:
        dist.barrier()


def test_every_rank_decides_alike(tmp_path: Path) -> None:
    results = run_distributed(_claim_where_only_rank_1_sees_a_run, 2, str(tmp_path), timeout=60)
    assert results[0] == results[1], results
    assert results[0].startswith("True --out-dir OUT holds another run (summary.json)")

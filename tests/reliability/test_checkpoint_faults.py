"""Checkpoint faults (docs/reliability.md F5, F6, F7 1→2, F8): torn, corrupt, disagreeing.

A kill while a checkpoint is written leaves the previous one selected; a bad checkpoint,
or ranks that found different ones, give the same error on every rank instead of one rank
raising while the others wait in a collective.
"""

from __future__ import annotations

import os
import re
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fault_helpers import (
    assert_bitwise_equal,
    final_checkpoint,
    one_thread,  # noqa: F401 (a fixture, used by name)
    train_options,
    write_tiny_data,
)

from distributed_helper import run_distributed, run_forked
from spdkfac.training.checkpoint import (
    atomic_torch_save,
    latest_checkpoint,
    load_common,
    step_directory,
)
from spdkfac.training.config import TrainConfig
from spdkfac.training.trainer import train

ENV = {k: v for k, v in os.environ.items() if k != "SPDKFAC_FAULT"} | {"OMP_NUM_THREADS": "1"}


def _killed_writer(victim: str, options: dict[str, Any]) -> None:
    """One process of ``spdkfac train`` whose checkpoint writer is SIGKILLed halfway
    through writing ``victim`` ("common.pt", "rank-0.pt" or "latest") of the step-10
    checkpoint (run in a process of its own)."""
    import signal
    import tempfile

    import spdkfac.training.checkpoint as checkpoint

    real_write = checkpoint.atomic_write_bytes

    def torn_write(path: Path, payload: bytes) -> None:
        tenth = path.parent.name == "step-00000010" or payload.startswith(b"step-00000010")
        if tenth and path.name == victim:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, _ = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.write(fd, payload[: len(payload) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, payload)

    checkpoint.atomic_write_bytes = torn_write  # type: ignore[assignment]
    train(TrainConfig.from_dict(options))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("fashion"))


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank run of 12 steps without faults (checkpoints at 10 and 12 are kept)."""
    threads = torch.get_num_threads()
    out = tmp_path_factory.mktemp("reference")
    try:
        train(TrainConfig.from_dict(train_options(data, out)), log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return out


# ---------------------------------------------------------------------- F5
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("victim", ["common.pt", "rank-0.pt", "latest"])
def test_f5_kill_while_writing_a_checkpoint_keeps_the_previous_one(
    victim: str, data: Path, reference: Path, tmp_path: Path
) -> None:
    options = train_options(data, tmp_path)
    killed = run_forked(_killed_writer, victim, options, timeout=120, env=ENV)
    assert killed.returncode == -9, killed.stderr[-3000:]
    root = tmp_path / "checkpoints"
    torn = step_directory(root, 10)
    if victim == "latest":  # every file written, the pointer not moved yet
        assert (torn / "common.pt").is_file() and (torn / "rank-0.pt").is_file()
    else:  # a half-written temporary file, never the file itself
        assert not (torn / victim).exists()
        assert any(p.name.startswith(f".{victim}.") for p in torn.iterdir())
    assert latest_checkpoint(root) == step_directory(root, 5)
    assert load_common(step_directory(root, 5))["step"] == 5
    # A restart resumes from step 5 and ends exactly where an uninterrupted run ends.
    logged: list[str] = []
    train(TrainConfig.from_dict(options), log=logged.append)
    assert any("step-00000005 at step 5" in line for line in logged), logged
    ours, theirs = final_checkpoint(tmp_path), final_checkpoint(reference)
    for part in ("step", "model", "optimizer", "preconditioner"):
        assert_bitwise_equal(ours[part], theirs[part], part)


# ---------------------------------------------------------------------- F6, F7, F8
def _resume_each(
    rank: int, world_size: int, variants: list[tuple[str, list[dict[str, Any]]]], store: str
) -> dict[str, tuple[Any, ...]]:
    """Resume every variant (its options per rank) on a fresh process group."""
    outcomes: dict[str, tuple[Any, ...]] = {}
    for index, (name, options) in enumerate(variants):
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store}/store-{index}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=30),
            )
        try:
            summary = train(TrainConfig.from_dict(options[rank % len(options)]), log=lambda _: None)
            outcomes[name] = ("ok", summary.steps, summary.replicas_identical)
        except Exception as error:  # train() left the process group; the next one joins anew
            outcomes[name] = (type(error).__name__, str(error))
    return outcomes


def _damaged_copy(source: Path, target: Path, damage: Any = None) -> Path:
    """A copy of ``source``'s output made to look like 2 ranks wrote it, then damaged."""
    shutil.copytree(source, target)
    directory = latest_checkpoint(target / "checkpoints")
    assert directory is not None
    shutil.copy(directory / "rank-0.pt", directory / "rank-1.pt")
    common = torch.load(directory / "common.pt", weights_only=True)
    common["world_size"] = 2
    atomic_torch_save(directory / "common.pt", common)
    if damage is not None:
        damage(directory)
    return target


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def _rewrite(path: Path, change: Any) -> None:
    common = torch.load(path, weights_only=True)
    change(common)
    atomic_torch_save(path, common)


def _extra_layer(common: dict[str, Any]) -> None:
    """The checkpoint of a model with one more Linear (fc4) than this one."""
    common["model"]["fc4.weight"] = torch.zeros(10, 10)
    common["model"]["fc4.bias"] = torch.zeros(10)
    layers = common["preconditioner"]["layers"]
    layers["fc4"] = {key: torch.eye(11 if key[0] == "a" else 10) for key in layers["fc3"]}


def _other_weights(common: dict[str, Any]) -> None:
    common["model"]["fc3.bias"] += 1


def test_f6_f7_f8_resume_outcomes_agree_on_every_rank(
    data: Path, reference: Path, tmp_path: Path
) -> None:
    def options(out: Path, **changes: Any) -> dict[str, Any]:
        return train_options(data, out, max_steps=16, **changes)

    def damaged(name: str, damage: Any = None) -> Path:
        return _damaged_copy(reference, tmp_path / name, damage)

    empty = tmp_path / "empty"
    empty.mkdir()
    grown = tmp_path / "grown"
    shutil.copytree(reference, grown)
    variants: list[tuple[str, list[dict[str, Any]]]] = [
        ("truncated", [options(damaged("truncated", lambda d: _truncate(d / "common.pt")))]),
        ("flipped", [options(damaged("flipped", lambda d: _flip_bytes(d / "common.pt")))]),
        (
            "format",
            [options(damaged("format", lambda d: _rewrite(d / "common.pt", _set_format)))],
        ),
        (
            "extra-layer",
            [options(damaged("extra-layer", lambda d: _rewrite(d / "common.pt", _extra_layer)))],
        ),
        ("rank-1-file", [options(damaged("rank-1-file", lambda d: _truncate(d / "rank-1.pt")))]),
        ("pointer", [options(damaged("pointer", lambda d: (d.parent / "latest").write_text("?")))]),
        # F8: ranks pointed at different checkpoints, or one at none.
        ("other-step", [options(damaged("step-12")), options(damaged("step-10", _point_at_10))]),
        (
            "other-run",
            [
                options(damaged("run-a")),
                options(damaged("run-b", lambda d: _rewrite(d / "common.pt", _other_weights))),
            ],
        ),
        ("one-missing", [options(damaged("present")), options(empty)]),
        # F7: a 1-rank checkpoint resumes on 2 ranks.
        ("grown", [options(grown)]),
    ]
    store = tmp_path / "stores"
    store.mkdir()
    ranks = run_distributed(_resume_each, 2, variants, str(store), timeout=110)
    for name, _ in variants:
        assert ranks[0][name] == ranks[1][name], (name, ranks[0][name], ranks[1][name])
    outcomes = ranks[0]
    expected = {
        "truncated": r"rank 0: .*truncated/checkpoints/step-00000012/common\.pt: cannot be read",
        "flipped": r"rank 0: .*flipped/checkpoints/step-00000012/common\.pt: cannot be read",
        "format": r"rank 0: .*format/checkpoints/step-00000012/common\.pt: format 99 is not 1",
        "extra-layer": r"common\.pt: does not fit this model .*Unexpected key\(s\).*fc4\.weight",
        "rank-1-file": r"rank 1: .*rank-1-file/checkpoints/step-00000012/rank-1\.pt: cannot be",
        "pointer": r"rank 0: .*pointer/checkpoints/latest: does not name a checkpoint",
        "other-step": r"ranks disagree on the checkpoint .*rank 0: step 12 .*rank 1: step 10",
        "other-run": r"ranks disagree on the checkpoint .*rank 0: step 12 .*rank 1: step 12",
        "one-missing": r"ranks disagree on the checkpoint .*rank 0: step 12 .*rank 1: none",
    }
    for name, pattern in expected.items():
        kind, message = outcomes[name]
        assert kind == "CheckpointError", (name, outcomes[name])
        assert re.search(pattern, message), (name, message)
    assert outcomes["grown"] == ("ok", 16, True)


def _set_format(common: dict[str, Any]) -> None:
    common["format"] = 99


def _point_at_10(directory: Path) -> None:
    (directory.parent / "latest").write_text("step-00000010\n")

"""Faults under torchrun (docs/reliability.md F1, F3, F7 2→1): kills, stalls, fewer ranks.

Every launch has a hard timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_helpers import (
    as_flags,
    assert_bitwise_equal,
    final_checkpoint,
    one_thread,  # noqa: F401 (a fixture, used by name)
    train_options,
    write_tiny_data,
)
from torch import nn

from distributed_helper import run_command, run_distributed, spdkfac_on_rank
from spdkfac import KFACPreconditioner
from spdkfac.training.config import TrainConfig
from spdkfac.training.faults import Fault, FaultPlan
from spdkfac.training.trainer import train

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# Restarted workers must not share torchrun's rendezvous store: they could read the gloo
# addresses of the killed attempt from it (pytorch/pytorch#135712).
ENV = {k: v for k, v in os.environ.items() if k != "SPDKFAC_FAULT"} | {
    "OMP_NUM_THREADS": "1",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}
STEPS = 12  # 8 steps per epoch on 2 ranks: the kill at step 7 is mid-epoch


def _torchrun(
    options: dict[str, Any], *extra: str, restarts: int = 0, fault: str = "", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    command = [
        TORCHRUN, "--standalone", "--nproc-per-node", "2", f"--max-restarts={restarts}",
        "--monitor-interval", "0.1", "-m", "spdkfac", "train", *as_flags(options), *extra,
    ]  # fmt: skip
    env = ENV | {"SPDKFAC_FAULT": fault} if fault else ENV
    return run_command(command, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("fashion"))


@pytest.fixture(scope="module")
def uninterrupted(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of a 2-rank run of STEPS steps without faults (``spdkfac
    train`` on two forked ranks: the launcher is not what F1 compares)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    flags = ["train", *as_flags(train_options(data, out, max_steps=STEPS))]
    env = ENV | {"SPDKFAC_FAULT": ""}  # added to this environment: no fault from there
    results = run_distributed(spdkfac_on_rank, 2, flags, timeout=120, env=env)
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    return out


def test_fault_plan_parses_and_fires_only_where_asked() -> None:
    plan = FaultPlan.from_env({"SPDKFAC_FAULT": "kill@7:rank1, nan@3"})
    assert plan.faults == (Fault("kill", 7, 1), Fault("nan", 3, None))
    images = torch.ones(2, 3)
    assert torch.isnan(plan.poison_batch(images, 3, 0)).all()
    assert torch.isnan(plan.poison_batch(images, 3, 1)).all()
    assert torch.equal(plan.poison_batch(images, 4, 0), images)
    plan.before_update(7, 0)  # another rank: nothing happens
    restarted = FaultPlan.from_env({"SPDKFAC_FAULT": "raise@2", "TORCHELASTIC_RESTART_COUNT": "1"})
    restarted.before_update(2, 0)  # a restarted worker runs through
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        FaultPlan.from_env({"SPDKFAC_FAULT": "raise@2"}).before_update(2, 0)
    assert FaultPlan.from_env({}).faults == ()
    with pytest.raises(ValueError, match="SPDKFAC_FAULT: 'explode@1'"):
        FaultPlan.from_env({"SPDKFAC_FAULT": "explode@1"})


def test_f1_killed_rank_restarts_and_resumes_bit_identically(
    data: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    options = train_options(data, out, max_steps=STEPS)
    result = _torchrun(options, restarts=1, fault="kill@7:rank1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no checkpoint" in result.stdout  # the first attempt started from scratch
    assert "step-00000005 at step 5" in result.stdout, result.stdout[-2000:]
    ours, theirs = final_checkpoint(out), final_checkpoint(uninterrupted)
    assert ours["step"] == theirs["step"] == STEPS
    for part in ("model", "optimizer", "preconditioner"):
        assert_bitwise_equal(ours[part], theirs[part], part)
    # Losses and accuracies of every epoch, including the one the kill interrupted.
    timing = ("epoch_seconds", "train_seconds")
    rows = [{k: v for k, v in row.items() if k not in timing} for row in ours["metrics"]]
    expected = [{k: v for k, v in row.items() if k not in timing} for row in theirs["metrics"]]
    assert rows == expected and len(rows) == 2
    assert '"replicas_identical": true' in (out / "summary.json").read_text()


def _stall_in_factor_allreduce(rank: int, world_size: int, stall: float, done: str) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    # spd-kfac launches factor buckets from backward hooks, on a group of their own.
    precond = KFACPreconditioner(model, strategy="spd-kfac")
    loss = model(torch.randn(4, 6)).sum()
    if rank == 1:
        # The peer never joins the factor all-reduce: it stays (so the survivor cannot
        # see it leave) for ``stall`` seconds or until the survivor is done.
        ends = time.monotonic() + stall
        while time.monotonic() < ends and not os.path.exists(done):
            time.sleep(0.05)
        return None
    started = time.monotonic()
    try:
        loss.backward()
        precond.step()
    except RuntimeError as error:
        return time.monotonic() - started, str(error)
    finally:
        Path(done).touch()
    return time.monotonic() - started, None


def test_f3_peer_stalling_in_factor_allreduce_fails_within_the_timeout(tmp_path: Path) -> None:
    timeout = 4.0
    done = str(tmp_path / "survivor-done")
    survivor, _ = run_distributed(
        _stall_in_factor_allreduce, 2, 3 * timeout, done, timeout=90, collective_timeout=timeout
    )
    elapsed, message = survivor
    assert message is not None, "the survivor returned from the factor all-reduce"
    assert "K-FAC factor all-reduce" in message and "rank 0 of 2" in message
    # A bound on a hang, not a speed check: the survivor gave up (after the timeout of the
    # world group, which the factor group inherits) instead of waiting for the peer.
    assert timeout * 0.5 <= elapsed < 3 * timeout


def test_f3_collective_timeout_option_ends_a_stalled_training_run(
    data: Path, tmp_path: Path
) -> None:
    options = train_options(data, tmp_path / "stalled", collective_timeout=5.0)
    # The stalled rank would sleep 600 s; the other fails after 5 s and torchrun stops
    # the group, well inside the subprocess timeout (whose expiry would fail the test).
    result = _torchrun(options, fault="stall@3:rank1", timeout=90)
    assert result.returncode != 0
    assert "timed out" in result.stderr.lower(), result.stderr[-3000:]


@pytest.mark.usefixtures("one_thread")
def test_f7_two_rank_checkpoint_resumes_on_one_rank(
    data: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    out = tmp_path / "shrunk"
    shutil.copytree(uninterrupted, out)
    saved = final_checkpoint(out)
    logged: list[str] = []
    options = train_options(data, out, max_steps=STEPS + 4)
    summary = train(TrainConfig.from_dict(options), log=logged.append)
    # The run flushed subnormal floats (TrainConfig's default) only while it ran.
    assert torch.tensor([1e-323], dtype=torch.float64).item() > 0
    assert any("resuming a 2-rank checkpoint on 1 ranks" in line for line in logged), logged
    assert summary.steps == STEPS + 4
    final = final_checkpoint(out)
    assert final["world_size"] == 1 and final["preconditioner"]["steps"] == STEPS + 4
    for name, layer in final["preconditioner"]["layers"].items():
        before = saved["preconditioner"]["layers"][name]
        for key, value in layer.items():
            assert value is not None and torch.isfinite(value).all(), (name, key)
            # The factors kept averaging from the saved ones; the inverses were refreshed.
            assert not torch.equal(value, before[key]), (name, key)

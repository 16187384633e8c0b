"""One trial, one ``spdkfac train`` run: launched, waited for, recorded atomically.

A run writes into ``runs/<id>.partial``; whatever a killed study left there (or in
``runs/<id>`` without a record) is deleted before the trial runs again. Only the record's
line in ``trials.jsonl`` makes the trial done (see :mod:`study.store`). The launcher is a
plain callable so tests can stand in for ``torchrun``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from spdkfac.calibrate import describe_device
from study.protocol import Trial
from study.store import TrialStore

__all__ = [
    "LaunchResult",
    "Launcher",
    "ProcessLauncher",
    "StudyInterruptedError",
    "allow_runs",
    "kill_running",
    "run_trial",
    "train_command",
]

#: summary.json keys a record keeps (the metrics rows hold the whole curve).
SUMMARY_KEYS = (
    "steps",
    "train_seconds",
    "eval_seconds",
    "median_iteration_ms",
    "world_size",
    "replicas_identical",
    "metrics",
)


@dataclass(frozen=True)
class LaunchResult:
    """How a run ended: exit status, wall seconds (process), output tails."""

    returncode: int
    seconds: float
    stdout_tail: str = ""
    stderr_tail: str = ""
    timed_out: bool = False


#: ``(spdkfac train flags, output directory, timeout in s) -> LaunchResult``.
Launcher = Callable[[list[str], Path, float], LaunchResult]


def train_command(flags: list[str], out_dir: Path, workers: int) -> list[str]:
    """``torchrun --standalone --nproc-per-node W -m spdkfac train ...`` (plain python for
    one worker)."""
    train = ["-m", "spdkfac", "train", *flags, "--out-dir", str(out_dir)]
    if workers == 1:
        return [sys.executable, *train]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", "--nproc-per-node", str(workers), *train]


#: The runs under way (trials may run side by side), for :func:`kill_running`.
_RUNNING: set[subprocess.Popen[str]] = set()
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()


def allow_runs() -> None:
    """Let runs start again after :func:`kill_running` (a study continued in-process)."""
    _STOPPING.clear()


class StudyInterruptedError(Exception):
    """A run was ended because the study was interrupted: it is not recorded."""


def kill_running() -> None:
    """End every run under way (the study was interrupted while trials ran side by side);
    their launchers raise :class:`StudyInterruptedError` instead of returning."""
    _STOPPING.set()
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for process in running:
        _kill_session(process)


class ProcessLauncher:
    """Runs ``spdkfac train`` in a session of its own, one thread per worker.

    On a timeout, or when the study itself is interrupted, the whole session (torchrun
    and its workers) is killed, so no orphan keeps a core busy.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def __call__(self, flags: list[str], out_dir: Path, timeout: float) -> LaunchResult:
        command = train_command(flags, out_dir, self.workers)
        started = time.perf_counter()
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        timed_out = False
        with _RUNNING_LOCK:
            _RUNNING.add(process)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(process)
            stdout, stderr = process.communicate()
            timed_out = True
        except BaseException:
            _kill_session(process)
            process.wait()
            raise
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(process)
        if _STOPPING.is_set():
            raise StudyInterruptedError(f"{out_dir.name}: ended with the study")
        return LaunchResult(
            process.returncode,
            time.perf_counter() - started,
            stdout[-2000:],
            stderr[-4000:],
            timed_out,
        )


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (Linux ``/proc``; none found elsewhere)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name (2nd field) may hold spaces: the parent follows its ")".
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            parents.setdefault(parent, []).append(int(stat.parent.name))
    found, frontier = [], [root]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def _kill_session(process: subprocess.Popen[str]) -> None:
    """End the run's processes: torchrun puts each worker in a process group of its own,
    so the tree is collected first, then torchrun asked to stop its workers (SIGTERM),
    then whatever is left killed."""
    tree = _descendants(process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    for pid in [process.pid, *tree]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    return dict(json.loads(path.read_text()))


def run_trial(
    trial: Trial,
    out: Path,
    launcher: Launcher,
    store: TrialStore,
    *,
    timeout: float,
    workers: int,
) -> dict[str, Any]:
    """Run ``trial`` from scratch and record it (ok, failed or timeout); its record."""
    final_dir = out / "runs" / trial.id
    partial = final_dir.with_name(trial.id + ".partial")
    for leftover in (partial, final_dir):
        shutil.rmtree(leftover, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    result = launcher(list(trial.flags), partial, timeout)
    summary = _read_summary(partial) if result.returncode == 0 else None
    status = "ok" if summary is not None else "timeout" if result.timed_out else "failed"
    if partial.exists():
        # The study reads summaries only; checkpoints would just fill the disk.
        shutil.rmtree(partial / "checkpoints", ignore_errors=True)
        partial.rename(final_dir)
    record: dict[str, Any] = {
        "id": trial.id,
        "workload": trial.workload,
        "optimizer": trial.optimizer,
        "phase": trial.phase,
        "index": trial.index,
        "seed": trial.seed,
        "hparams": trial.hparams,
        "flags": list(trial.flags),
        "command": shlex.join(train_command(list(trial.flags), final_dir, workers)),
        "status": status,
        "returncode": result.returncode,
        "process_seconds": round(result.seconds, 3),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": describe_device(torch.device("cpu")),
    }
    if summary is not None:
        record["summary"] = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
        record["scores"] = {k: v for k, v in summary.items() if k not in SUMMARY_KEYS}
    else:
        record["error"] = (result.stderr_tail or result.stdout_tail)[-1500:]
    store.append(record)
    return record

"""Run a function on N gloo ranks in fresh processes, with a hard timeout and tracebacks.

On Linux the ranks are forked from a multiprocessing fork server that imported torch and
spdkfac once (started by the first call): a fresh world then starts in a fraction of a
second, where spawning one (a new interpreter importing torch per rank) took seconds per
rank. Every call still gets new processes, so nothing a target does (process-group state,
environment, monkeypatches, exit hooks) reaches the next call. The ranks get this
process's environment, working directory and ``sys.path`` as they are at the call.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from process_helper import kill_process_tree, run_command

__all__ = [
    "RecordingCommunicator",
    "kill_process_tree",
    "run_command",
    "run_distributed",
    "run_forked",
    "spdkfac_on_rank",
    "start_fork_server",
]

#: What the fork server imports once for every rank it forks (import errors are ignored).
#: torch._dynamo (with sympy, ~800 modules) is imported lazily by the first DDP forward:
#: seconds in every fresh rank unless the server has it.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "pytest",
            "spdkfac", "distributed_helper"]  # fmt: skip


def _context() -> Any:
    # Elsewhere (macOS: fork after importing torch is unsafe there), spawned interpreters.
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts (first call)
    return context


def start_fork_server() -> None:
    """Start the fork server now: it imports in the background while other tests run, and
    takes this process's state (``sys.path``, modules) before any test changed it."""
    if sys.platform.startswith("linux"):
        _context()
        mp.forkserver.ensure_running()


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    collective_timeout: float,
    env: dict[str, str],
) -> None:
    # The caller's environment now, not the fork server's from when it started.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    # torch read TORCH_DISTRIBUTED_DEBUG when it was imported (in the fork server, or while
    # unpickling this call), before ``env`` was applied: read it again.
    dist.set_debug_level_from_env()  # type: ignore[attr-defined]
    torch.set_num_threads(1)
    # Forked ranks share the server's generator states; a spawned rank had its own seeds.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        value = target(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    collective_timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results.

    ``target`` must be a module-level function (it is pickled into the new processes) and
    its return value must be ``torch.save``-able. ``env`` is added to this process's
    environment for the ranks. Raises ``AssertionError`` listing every failing rank's
    traceback, or naming the ranks that did not finish within ``timeout`` seconds (they
    are killed, so a hang fails fast).
    """
    context = _context()
    results = context.Queue()
    environment = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        processes = [
            context.Process(
                target=_worker,
                args=(
                    rank,
                    world_size,
                    init_file,
                    target,
                    args,
                    results,
                    collective_timeout,
                    environment,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            for process in processes:
                process.start()
            while len(outcomes) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    if all(not p.is_alive() for p in processes) and results.empty():
                        break
                    continue
                outcomes[rank] = (status, payload)
        finally:  # also on KeyboardInterrupt or pytest-timeout: no rank outlives the call
            for rank, process in enumerate(processes):
                if process.pid is None:  # never started
                    continue
                if rank in outcomes:  # leaving the group; one without a result hangs
                    process.join(timeout=5)
                if process.is_alive():
                    kill_process_tree(process.pid)  # its own children too
                    process.join()
    errors = [f"--- rank {r} ---\n{p}" for r, (s, p) in sorted(outcomes.items()) if s == "error"]
    for rank in sorted(set(range(world_size)) - set(outcomes)):
        code = processes[rank].exitcode
        why = f"died with exit code {code}" if code not in (None, -9) else f"hung ({timeout} s)"
        errors.append(f"rank {rank} returned no result: {why}")
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]


def _forked(
    target: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str], output: str
) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.seed()
    with open(output, "wb") as sink:  # stdout and stderr, file descriptors included
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    target(*args)


def run_forked(
    target: Callable[..., Any], *args: Any, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``target(*args)`` in one new process, forked as :func:`run_distributed`'s ranks
    are (without a process group), with ``env`` as its environment (default: this one's).

    Returns its exit code (negative: the signal that ended it) and its output (stdout and
    stderr together, in both fields). Like :func:`run_command`, kills it and raises
    ``subprocess.TimeoutExpired`` when it outlives ``timeout`` seconds.
    """
    context = _context()
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "output")
        environment = dict(os.environ if env is None else env)
        process = context.Process(target=_forked, args=(target, args, environment, output))
        try:
            process.start()
            process.join(timeout)
        finally:
            if process.pid is not None and process.is_alive():
                kill_process_tree(process.pid)
                process.join()
                timed_out = True
            else:
                timed_out = False
        text = Path(output).read_text(errors="replace") if os.path.exists(output) else ""
    name = getattr(target, "__name__", repr(target))
    if timed_out:
        raise subprocess.TimeoutExpired(name, timeout, output=text, stderr=text)
    return subprocess.CompletedProcess([name], process.exitcode or 0, text, text)


def spdkfac_on_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str, str]:
    """A :func:`run_distributed` target: ``spdkfac *argv`` on this rank, in the world the
    helper set up (as torchrun's workers join theirs); its exit code, stdout and stderr."""
    from spdkfac.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, out.getvalue(), err.getvalue()


class RecordingCommunicator:
    """Wraps a communicator and logs every collective as ``(op, numel, dtype)``.

    Passed as ``process_group=`` to the preconditioner, it records the collectives a rank
    issues so tests can compare them across ranks; ``duplicate()`` shares the log, tagging
    the new group's entries.
    """

    def __init__(
        self, inner: Any, log: list[tuple[str, int, str]] | None = None, tag: str = ""
    ) -> None:
        self.inner = inner
        self.log: list[tuple[str, int, str]] = [] if log is None else log
        self.tag = tag

    @property
    def rank(self) -> int:
        return int(self.inner.rank)

    @property
    def world_size(self) -> int:
        return int(self.inner.world_size)

    @property
    def device(self) -> torch.device:
        return self.inner.device  # type: ignore[no-any-return]

    def _record(self, op: str, tensor: torch.Tensor) -> None:
        self.log.append((f"{self.tag}{op}", tensor.numel(), str(tensor.dtype)))

    def all_reduce_sum(self, tensor: torch.Tensor) -> Any:
        self._record("all_reduce_sum", tensor)
        return self.inner.all_reduce_sum(tensor)

    def all_reduce_average(self, tensor: torch.Tensor) -> Any:
        self._record("all_reduce_average", tensor)
        return self.inner.all_reduce_average(tensor)

    def all_reduce_max(self, tensor: torch.Tensor) -> Any:
        self._record("all_reduce_max", tensor)
        return self.inner.all_reduce_max(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        self._record(f"broadcast(src={src})", tensor)
        return self.inner.broadcast(tensor, src)

    def all_gather(self, tensor: torch.Tensor) -> Any:
        self._record("all_gather", tensor)
        return self.inner.all_gather(tensor)

    def reduce_scatter(self, chunks: Any) -> Any:
        sizes = ",".join(str(chunk.numel()) for chunk in chunks)
        self.log.append(
            (
                f"{self.tag}reduce_scatter({sizes})",
                sum(c.numel() for c in chunks),
                str(chunks[0].dtype),
            )
        )
        return self.inner.reduce_scatter(chunks)

    def duplicate(self) -> RecordingCommunicator:
        return RecordingCommunicator(self.inner.duplicate(), self.log, tag=self.tag + "dup:")

"""Run a function on N gloo ranks in spawned processes, with a hard timeout and tracebacks;
run a command (``torchrun``, ``python -m spdkfac``) with a timeout that ends all it started."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RecordingCommunicator", "kill_process_tree", "run_command", "run_distributed"]


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
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    # torch read TORCH_DISTRIBUTED_DEBUG when it was imported (while unpickling this call),
    # before ``env`` was applied: read it again.
    dist.set_debug_level_from_env()  # type: ignore[attr-defined]
    torch.set_num_threads(1)
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

    ``target`` must be a module-level function (it is pickled into spawned processes) and
    its return value must be ``torch.save``-able. Raises ``AssertionError`` listing every
    failing rank's traceback, or naming the ranks that did not finish within ``timeout``
    seconds (they are killed, so a hang fails fast).
    """
    context = mp.get_context("spawn")
    results = context.Queue()
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
                    env or {},
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
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
        finally:
            for process in processes:
                process.join(timeout=5)
                if process.is_alive() and process.pid is not None:
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


def _children() -> dict[int, list[int]]:
    """Parent pid → pids of its children, read from ``/proc`` (empty without one)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return children
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read()
        except OSError:  # ended meanwhile
            continue
        # "pid (command) state ppid ...": the command may hold spaces and parentheses.
        parent = int(fields[fields.rindex(b")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(name))
    return children


def _descendants(root: int) -> list[int]:
    tree, found, stack = _children(), [], [root]
    while stack:
        for child in tree.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _send(pid: int, sig: signal.Signals, *, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # ended meanwhile
        (os.killpg if group else os.kill)(pid, sig)


def kill_process_tree(root: int) -> None:
    """SIGKILL ``root`` and every process it started, directly or not.

    torchrun (and ``spdkfac bench``) start each worker in a session of its own, so
    killing the launcher's process group misses them: they would live on, holding the
    pipes the test reads. The tree is frozen first (SIGSTOP, repeated until no process
    appears: nothing forks or restarts a worker meanwhile), then every process and the
    process group each leads (never the caller's own group) is killed.
    """
    stopped: list[int] = []
    while True:
        new = [pid for pid in (root, *_descendants(root)) if pid not in stopped]
        if not new:
            break
        for pid in new:
            _send(pid, signal.SIGSTOP)
        stopped += new
    own = os.getpgrp()
    for pid in stopped:
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if group == pid and group != own:  # a session or group leader: its whole group
            _send(pid, signal.SIGKILL, group=True)
        _send(pid, signal.SIGKILL)


def run_command(
    command: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, timeout=..., env=...)``,
    except that a timeout ends everything the command started.

    The command runs in a session of its own; when it outlives ``timeout`` seconds, it
    and all its descendants (torchrun's workers included, see :func:`kill_process_tree`)
    are killed before ``subprocess.TimeoutExpired`` is raised, so no worker survives the
    test and the output pipes close.
    """
    with subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(process.pid)
            try:
                stdout, stderr = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # an escaped process still holds a pipe
                stdout, stderr = "", ""
            raise subprocess.TimeoutExpired(
                process.args, timeout, output=stdout, stderr=stderr
            ) from None
        except BaseException:  # KeyboardInterrupt, pytest-timeout: end the tree too
            kill_process_tree(process.pid)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


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

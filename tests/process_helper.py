"""Run a command (``torchrun``, ``python -m spdkfac``) with a timeout that ends all it
started; kill a process and every process it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["kill_process_tree", "run_command"]


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

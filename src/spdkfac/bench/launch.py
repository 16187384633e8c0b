"""Starting the benchmark's ranks: local processes on loopback or in an emulated cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import IO

import spdkfac
from spdkfac.bench.netns import Cluster

__all__ = [
    "LIVE_PROGRESS_ENV",
    "MASTER_PORT",
    "free_port",
    "launch_ranks",
    "rank_commands",
    "run_ranks",
]

#: Set to 1 for workers whose stderr the launcher forwards to a terminal.
LIVE_PROGRESS_ENV = "SPDKFAC_PROGRESS_LIVE"
_TAIL_BYTES = 6000
MASTER_PORT = 29577  # inside fresh namespaces every port is free


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Rank:
    """A started rank: its process and the tail of its stderr (rank 0's is also shown)."""

    def __init__(self, rank: int, command: Sequence[str], env: Mapping[str, str]) -> None:
        self.rank = rank
        self.tail = bytearray()
        self._lock = threading.Lock()
        # A session of its own, so a kill reaches whatever the rank started, and only that.
        self.process = subprocess.Popen(
            list(command), env=dict(env), stderr=subprocess.PIPE, start_new_session=True
        )
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._pump, args=(self.process.stderr,))
        self._reader.daemon = True
        self._reader.start()

    def _pump(self, stream: IO[bytes]) -> None:
        show = self.rank == 0
        while chunk := os.read(stream.fileno(), 4096):
            with self._lock:
                self.tail.extend(chunk)
                del self.tail[:-_TAIL_BYTES]
            if show:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()

    def stderr_tail(self) -> str:
        """The last few kilobytes the rank wrote to stderr."""
        self._reader.join(timeout=2)
        with self._lock:
            return self.tail.decode(errors="replace")

    def kill(self) -> None:
        """Kill the rank's process group if it is still running."""
        if self.process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _report_failure(ranks: Sequence[_Rank], failed: _Rank | None, timeout: float) -> None:
    if failed is None:
        print(f"spdkfac bench: timed out after {timeout:.0f} s; killed every rank", file=sys.stderr)
        shown = ranks
    else:
        code = failed.process.returncode
        print(
            f"spdkfac bench: rank {failed.rank} exited with code {code}; killed the others",
            file=sys.stderr,
        )
        shown = [failed]
    for rank in shown:
        tail = rank.stderr_tail().strip()
        print(f"--- last lines of rank {rank.rank}'s stderr ---\n{tail}", file=sys.stderr)


def run_ranks(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], timeout: float) -> int:
    """Start one process per ``(argv, env)`` (rank = position) and wait for all of them.

    A rank that exits non-zero, or the ``timeout``, kills every other rank (each runs in a
    session of its own, so whatever it started goes too) and prints the failing rank's
    stderr tail (all tails on a timeout). Rank 0's stderr is forwarded as it comes.

    Returns:
        0 when every rank succeeded; else the failing rank's exit code (1 on a timeout or
        a rank killed by a signal).
    """
    ranks: list[_Rank] = []
    failed: _Rank | None = None
    deadline = time.monotonic() + timeout
    try:
        for index, (argv, env) in enumerate(commands):
            ranks.append(_Rank(index, argv, env))
        while time.monotonic() < deadline:
            codes = [rank.process.poll() for rank in ranks]
            failed = next(
                (r for r, c in zip(ranks, codes, strict=True) if c not in (None, 0)), None
            )
            if failed is not None or all(code == 0 for code in codes):
                break
            time.sleep(0.1)
    finally:
        for started in ranks:
            started.kill()
    if failed is None and all(rank.process.returncode == 0 for rank in ranks):
        return 0
    _report_failure(ranks, failed, timeout)
    code = 1 if failed is None else failed.process.returncode
    return code if code and code > 0 else 1


def rank_commands(
    argv: Sequence[str], *, nproc: int, cluster: Cluster | None, port: int = MASTER_PORT
) -> list[tuple[Sequence[str], Mapping[str, str]]]:
    """``argv`` once per rank with the environment of a gloo world of ``nproc`` ranks.

    On loopback (``cluster`` None) the ranks meet on a free local port; in an emulated
    cluster each runs in its own namespace and they meet at rank 0's address on ``port``.
    """
    package_root = str(Path(spdkfac.__file__).resolve().parents[1])
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    base = {
        "WORLD_SIZE": str(nproc),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": python_path,
        LIVE_PROGRESS_ENV: "1" if sys.stderr.isatty() else "0",
    }
    meeting_port = str(free_port() if cluster is None else port)
    commands: list[tuple[Sequence[str], Mapping[str, str]]] = []
    for rank in range(nproc):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_PORT": meeting_port}
        if cluster is None:
            env["MASTER_ADDR"] = "127.0.0.1"
            commands.append((list(argv), {**os.environ, **env}))
        else:
            env["MASTER_ADDR"] = cluster.addresses[0]
            env["GLOO_SOCKET_IFNAME"] = cluster.interfaces[rank]
            commands.append((cluster.command(rank, argv, env), dict(os.environ)))
    return commands


def launch_ranks(
    worker_argv: Sequence[str], *, nproc: int, cluster: Cluster | None, timeout: float
) -> int:
    """Run ``python -m spdkfac bench WORKER_ARGV`` as ``nproc`` ranks (see :func:`run_ranks`).

    On loopback (``cluster`` None) the ranks meet on a free local port; in an emulated
    cluster (:func:`~spdkfac.bench.netns.emulated_cluster`, which the caller enters and
    tears down) each runs in its own namespace behind the link's cap.

    Returns:
        0 when every rank succeeded, else a non-zero exit code.
    """
    command = [sys.executable, "-m", "spdkfac", "bench", *worker_argv]
    return run_ranks(rank_commands(command, nproc=nproc, cluster=cluster), timeout)

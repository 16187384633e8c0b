"""An emulated cluster on one machine: one network namespace per rank, a ``tc`` bandwidth cap."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Cluster", "available", "check_rate", "emulated_cluster"]

_RATE = re.compile(r"^\d+(\.\d+)?([kmg]?bit|[kmg]?bps)$", re.IGNORECASE)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Cluster:
    """Namespaces, interfaces and addresses of an emulated cluster, one of each per rank."""

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]

    def command(self, rank: int, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """``argv`` wrapped to run inside rank ``rank``'s namespace with ``env`` added."""
        assignments = [f"{key}={value}" for key, value in env.items()]
        return ["ip", "netns", "exec", self.namespaces[rank], "env", *assignments, *argv]


def available() -> bool:
    """Whether this process may create namespaces (root, with ``ip`` and ``tc`` present)."""
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc"))


def check_rate(rate: str) -> str:
    """``rate`` if ``tc`` understands it as a bandwidth (``1gbit``, ``100mbit``, ``500kbit``).

    Raises:
        ValueError: Naming the bad value.
    """
    if not _RATE.match(rate):
        raise ValueError(f"link rate must look like 1gbit, 100mbit or 500kbit, got {rate!r}")
    return rate


@contextmanager
def emulated_cluster(ranks: int, rate: str = "1gbit") -> Iterator[Cluster]:
    """Create ``ranks`` namespaces on a bridge, each link capped at ``rate`` by ``tbf``.

    Each rank runs inside its own namespace, joined by a veth pair to a bridge in one more
    namespace (the ``--link RATE`` set-up of ``spdkfac bench``, docs/cli.md). Everything
    created carries a per-process prefix and is torn down on exit, failure included.

    Raises:
        PermissionError: Without root or iproute2.
        ValueError: On a bad ``ranks`` or ``rate``.
    """
    if ranks < 1 or ranks > 250:
        raise ValueError(f"ranks must be in [1, 250], got {ranks}")
    check_rate(rate)
    if not available():
        raise PermissionError("the emulated cluster needs root and iproute2 (ip, tc)")
    tag = f"kfb{os.getpid() % 100000}"
    bridge_ns = f"{tag}br"
    namespaces = tuple(f"{tag}r{r}" for r in range(ranks))
    interfaces = tuple(f"{tag}v{r}" for r in range(ranks))
    subnet = 10 + os.getpid() % 200
    addresses = tuple(f"10.78.{subnet}.{r + 1}" for r in range(ranks))
    created: list[str] = []
    try:
        _ip("netns", "add", bridge_ns)
        created.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for rank, (namespace, interface, address) in enumerate(
            zip(namespaces, interfaces, addresses, strict=True)
        ):
            _ip("netns", "add", namespace)
            created.append(namespace)
            peer = f"{tag}p{rank}"
            _ip("link", "add", interface, "type", "veth", "peer", "name", peer)
            _ip("link", "set", interface, "netns", namespace)
            _ip("link", "set", peer, "netns", bridge_ns)
            _ip("-n", bridge_ns, "link", "set", peer, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", peer, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface,
                 "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        yield Cluster(namespaces, interfaces, addresses)
    finally:
        # Deleting a namespace removes its veth ends (and so their peers) with it.
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)

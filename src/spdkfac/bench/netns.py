"""An emulated cluster on one machine: one network namespace per rank, a bandwidth cap.

Used by the benchmarks to launch each rank inside its own namespace, joined by veth pairs
to a bridge, with ``tc tbf`` capping every rank's link (see the project's CLUSTER.md). Needs
root; everything it creates carries a per-run prefix and is torn down on exit, failure
included.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Cluster:
    """Namespaces, interfaces and addresses of an emulated cluster."""

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]

    def command(self, rank: int, argv: Sequence[str], env: dict[str, str]) -> list[str]:
        """``argv`` wrapped to run inside rank ``rank``'s namespace with ``env``."""
        assignments = [f"{key}={value}" for key, value in env.items()]
        return ["ip", "netns", "exec", self.namespaces[rank], "env", *assignments, *argv]


def available() -> bool:
    """Whether this process may create namespaces (root and iproute2 present)."""
    return (
        os.geteuid() == 0 and subprocess.run(["which", "ip"], capture_output=True).returncode == 0
    )


@contextmanager
def emulated_cluster(ranks: int, rate: str = "1gbit") -> Iterator[Cluster]:
    """Create ``ranks`` namespaces on a bridge, each link capped at ``rate`` by ``tbf``."""
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
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)

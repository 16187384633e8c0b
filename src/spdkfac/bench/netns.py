"""An emulated cluster on one machine: one network namespace per rank, a ``tc`` bandwidth cap."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BURST_SECONDS",
    "Cluster",
    "LinkShape",
    "available",
    "check_rate",
    "emulated_cluster",
    "link_shape",
    "rate_bits_per_second",
]

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)$", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}

#: Seconds of traffic at the capped rate that the token bucket holds (see :func:`link_shape`).
BURST_SECONDS = 0.5e-3
_FRAME_BYTES = 1514  # one full Ethernet frame at MTU 1500
_MIN_BURST_BYTES = 4 * _FRAME_BYTES
_GSO_DEFAULT_BYTES = 65536  # the kernel's largest GSO packet on a veth
_LATENCY_MS = 50.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def rate_bits_per_second(rate: str) -> float:
    """Bits per second of a ``tc`` rate (``1gbit``: 1e9; ``kbps`` is kilobytes per second).

    Raises:
        ValueError: Naming the bad value.
    """
    match = _RATE.match(rate)
    if not match:
        raise ValueError(f"link rate must look like 1gbit, 100mbit or 500kbit, got {rate!r}")
    number, prefix, unit = match.groups()
    bits = float(number) * _PREFIX[prefix.lower()] * (8.0 if unit.lower() == "bps" else 1.0)
    if bits <= 0:
        raise ValueError(f"link rate must be positive, got {rate!r}")
    return bits


def check_rate(rate: str) -> str:
    """``rate`` if ``tc`` understands it as a bandwidth (``1gbit``, ``100mbit``, ``500kbit``).

    Raises:
        ValueError: Naming the bad value.
    """
    rate_bits_per_second(rate)
    return rate


@dataclass(frozen=True)
class LinkShape:
    """How each rank's link is capped: a ``tbf`` qdisc on its veth and the veth's GSO size.

    Attributes:
        rate: The ``tc`` rate (``1gbit``).
        burst_bytes: The token bucket's size.
        latency_ms: Longest a packet may wait in the queue (sets tbf's queue limit).
        gso_max_size: Largest packet the veth hands to the qdisc (bytes).
    """

    rate: str
    burst_bytes: int
    latency_ms: float
    gso_max_size: int

    @property
    def burst_seconds(self) -> float:
        """Time the link needs at its rate to send one full bucket."""
        return 8.0 * self.burst_bytes / rate_bits_per_second(self.rate)

    def tbf_arguments(self) -> list[str]:
        """The qdisc part of ``tc qdisc add dev DEV root ...``."""
        return ["tbf", "rate", self.rate, "burst", str(self.burst_bytes),
                "latency", f"{self.latency_ms:g}ms"]  # fmt: skip

    def describe(self) -> str:
        """``tbf rate 1gbit burst 62500 latency 50ms`` and what the burst amounts to."""
        return (
            f"`{' '.join(self.tbf_arguments())}` (burst = {1e3 * self.burst_seconds:.2f} ms "
            f"at the rate), veth GSO size {self.gso_max_size} B"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_json`)."""
        return {"rate": self.rate, "rate_bits_per_second": rate_bits_per_second(self.rate),
                "burst_bytes": self.burst_bytes, "latency_ms": self.latency_ms,
                "gso_max_size": self.gso_max_size}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkShape:
        """Rebuild a shape from :meth:`to_json`'s output."""
        return cls(
            rate=check_rate(str(data["rate"])),
            burst_bytes=int(data["burst_bytes"]),
            latency_ms=float(data["latency_ms"]),
            gso_max_size=int(data["gso_max_size"]),
        )


def link_shape(rate: str, *, burst_bytes: int | None = None) -> LinkShape:
    """The cap each rank's link gets at ``rate``: a token bucket of :data:`BURST_SECONDS`.

    A transfer that finds the bucket full sends its first ``burst`` bytes at veth speed
    (about 1 GB/s here), not at the rate, so the bucket is what lets short transfers beat
    the link. The former fixed 256 KiB (2.1 ms at 1 Gbit/s) ran 256 KiB broadcasts at
    0.22-0.30 GB/s on a 0.125 GB/s link; 1 ms of burst gave 0.15 GB/s, 0.5 ms 0.09-0.12.
    So the bucket holds 0.5 ms at the rate (62,500 B at 1 Gbit/s; at least four full
    frames), which still reaches the rate on large messages: tc-tbf(8)'s
    ``burst >= rate/HZ`` is the rule for tick-driven timers, but tbf waits on
    high-resolution timers (``CONFIG_HIGH_RES_TIMERS``), so the bucket only has to cover
    how late its wake-ups run. On this shared 2-core machine a 16 MiB all-reduce reached
    0.10-0.12 GB/s with buckets of 0.25-2 ms alike (run-to-run noise is as large).

    The bucket must also hold the largest packet: tbf cuts a GSO packet longer than the
    burst into frames in software, which here dropped a 16 MiB all-reduce to 0.07 GB/s (a
    64 KiB bucket under 64 KiB GSO packets). So the veth's GSO size is half the burst (at
    most the kernel's default 64 KiB). ``latency 50ms`` makes the queue deep enough
    (rate x 50 ms + burst) that it does not drop: a drop costs TCP a retransmission
    timeout of at least 200 ms, while queueing only delays.

    Args:
        rate: A ``tc`` rate.
        burst_bytes: Overrides the bucket size (at least four full frames, 6,056 B).

    Raises:
        ValueError: On a bad ``rate`` or ``burst_bytes``.
    """
    bytes_per_second = rate_bits_per_second(rate) / 8.0
    if burst_bytes is None:
        burst_bytes = max(_MIN_BURST_BYTES, math.ceil(bytes_per_second * BURST_SECONDS))
    elif burst_bytes < _MIN_BURST_BYTES:
        raise ValueError(f"burst_bytes must be >= {_MIN_BURST_BYTES}, got {burst_bytes}")
    gso = min(_GSO_DEFAULT_BYTES, burst_bytes // 2)
    return LinkShape(rate=rate, burst_bytes=burst_bytes, latency_ms=_LATENCY_MS, gso_max_size=gso)


@dataclass(frozen=True)
class Cluster:
    """Namespaces, interfaces and addresses of an emulated cluster, one of each per rank,
    and the cap on every rank's link."""

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]
    shape: LinkShape

    def command(self, rank: int, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """``argv`` wrapped to run inside rank ``rank``'s namespace with ``env`` added."""
        assignments = [f"{key}={value}" for key, value in env.items()]
        return ["ip", "netns", "exec", self.namespaces[rank], "env", *assignments, *argv]


def available() -> bool:
    """Whether this process may create namespaces (root, with ``ip`` and ``tc`` present)."""
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc"))


@contextmanager
def emulated_cluster(
    ranks: int, rate: str = "1gbit", *, burst_bytes: int | None = None
) -> Iterator[Cluster]:
    """Create ``ranks`` namespaces on a bridge, each link capped at ``rate`` by ``tbf``.

    Each rank runs inside its own namespace, joined by a veth pair to a bridge in one more
    namespace (the ``--link RATE`` set-up of ``spdkfac bench``, docs/cli.md); the cap on
    each rank's veth is :func:`link_shape`'s (``burst_bytes`` overrides its bucket).
    Everything created carries a per-process prefix and is torn down on exit, failure
    included.

    Raises:
        PermissionError: Without root or iproute2.
        ValueError: On a bad ``ranks``, ``rate`` or ``burst_bytes``.
    """
    if ranks < 1 or ranks > 250:
        raise ValueError(f"ranks must be in [1, 250], got {ranks}")
    shape = link_shape(rate, burst_bytes=burst_bytes)
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
            # Before any socket exists: TCP reads the GSO size when it connects.
            _ip("-n", namespace, "link", "set", interface, "gso_max_size", str(shape.gso_max_size))
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface,
                 "root", *shape.tbf_arguments()],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        yield Cluster(namespaces, interfaces, addresses, shape)
    finally:
        # Deleting a namespace removes its veth ends (and so their peers) with it.
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)

"""The emulated link's cap (pure), and as root the cluster that applies it and its probe."""

from __future__ import annotations

import json
import subprocess

import pytest

from spdkfac.bench.link import MeasuredLink
from spdkfac.bench.linkprobe import probe_cluster
from spdkfac.bench.netns import (
    BURST_SECONDS,
    LinkShape,
    available,
    check_rate,
    emulated_cluster,
    link_shape,
    rate_bits_per_second,
)

_FRAME = 1514


@pytest.mark.parametrize(
    ("rate", "bits"),
    [("1gbit", 1e9), ("100mbit", 1e8), ("500kbit", 5e5), ("1Gbit", 1e9), ("2.5gbit", 2.5e9),
     ("10mbps", 8e7), ("800bit", 800.0)],
)  # fmt: skip
def test_rates_read_as_tc_reads_them(rate: str, bits: float) -> None:
    assert rate_bits_per_second(rate) == pytest.approx(bits)
    assert check_rate(rate) == rate


@pytest.mark.parametrize("rate", ["fast", "1 gbit", "-1gbit", "0gbit", "1tbit", ""])
def test_bad_rates_are_refused(rate: str) -> None:
    with pytest.raises(ValueError, match="link rate"):
        rate_bits_per_second(rate)


def test_one_gigabit_gets_half_a_millisecond_of_burst_and_packets_half_that() -> None:
    shape = link_shape("1gbit")
    assert (shape.burst_bytes, shape.gso_max_size, shape.latency_ms) == (62500, 31250, 50.0)
    assert shape.burst_seconds == pytest.approx(BURST_SECONDS)
    assert shape.tbf_arguments() == [
        "tbf", "rate", "1gbit", "burst", "62500", "latency", "50ms",
    ]  # fmt: skip
    assert "burst = 0.50 ms at the rate" in shape.describe()


@pytest.mark.parametrize(
    ("rate", "burst", "gso"),
    [("100mbit", 6250, 3125), ("1mbit", 4 * _FRAME, 2 * _FRAME), ("10gbit", 625000, 65536)],
)
def test_slow_links_keep_four_frames_and_fast_ones_the_default_gso(
    rate: str, burst: int, gso: int
) -> None:
    shape = link_shape(rate)
    assert (shape.burst_bytes, shape.gso_max_size) == (burst, gso)


@pytest.mark.parametrize("rate", ["64kbit", "1mbit", "100mbit", "1gbit", "2500mbit", "40gbit"])
def test_every_packet_fits_twice_in_the_bucket(rate: str) -> None:
    # tbf cuts a packet longer than the bucket into frames in software; a bucket of two
    # packets also absorbs a late wake-up of one packet's time.
    shape = link_shape(rate)
    assert shape.gso_max_size >= 2 * _FRAME
    assert 2 * shape.gso_max_size <= shape.burst_bytes
    assert shape.burst_seconds <= BURST_SECONDS or shape.burst_bytes == 4 * _FRAME


def test_an_explicit_burst_keeps_the_default_gso_when_it_is_large() -> None:
    old = link_shape("1gbit", burst_bytes=256 * 1024)
    assert (old.burst_bytes, old.gso_max_size) == (262144, 65536)
    with pytest.raises(ValueError, match="burst_bytes must be >= 6056, got 1500"):
        link_shape("1gbit", burst_bytes=1500)


def test_shape_json_round_trip() -> None:
    shape = link_shape("100mbit")
    data = json.loads(json.dumps(shape.to_json()))
    assert data["rate_bits_per_second"] == 1e8
    assert LinkShape.from_json(data) == shape


def test_cluster_arguments_are_checked_before_anything_is_created() -> None:
    with pytest.raises(ValueError, match="ranks"), emulated_cluster(0):
        pass
    with pytest.raises(ValueError, match="link rate"), emulated_cluster(2, "fast"):
        pass


_ROOT = pytest.mark.skipif(not available(), reason="needs root and iproute2 (ip, tc)")


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


@_ROOT
def test_the_cluster_applies_the_shape_and_its_link_can_be_measured() -> None:
    sizes = (4096, 65536)
    with emulated_cluster(2, "1gbit") as cluster:
        created = set(cluster.namespaces)
        namespace, interface = cluster.namespaces[1], cluster.interfaces[1]
        qdisc = subprocess.run(
            ["ip", "netns", "exec", namespace, "tc", "-j", "qdisc", "show", "dev", interface],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        options = json.loads(qdisc.stdout)[0]["options"]
        assert options["rate"] == 125_000_000  # bytes per second
        # tc stores the bucket as a time in its clock's ticks: 62,375 B here.
        assert options["burst"] == pytest.approx(cluster.shape.burst_bytes, rel=0.01)
        link = subprocess.run(
            ["ip", "-n", namespace, "-d", "-j", "link", "show", "dev", interface],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert json.loads(link.stdout)[0]["gso_max_size"] == cluster.shape.gso_max_size
        measured = probe_cluster(cluster, timeout=120, sizes=sizes)
    assert not created & _namespaces()  # torn down
    assert measured is not None and measured.world_size == 2
    assert [size for size, _ in measured.allreduce] == list(sizes)
    assert [size for size, _ in measured.broadcast] == list(sizes)
    assert (
        MeasuredLink(cluster.shape, measured)
        .label()
        .startswith("emulated (tbf setting 1gbit): measured ")
    )

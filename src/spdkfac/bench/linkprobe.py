"""Measuring an emulated cluster's link with gloo, from inside the ranks' namespaces."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from spdkfac.bench.launch import MASTER_PORT, rank_commands, run_ranks
from spdkfac.bench.link import LinkMeasurement
from spdkfac.bench.netns import Cluster
from spdkfac.calibrate import measure_collectives
from spdkfac.comm import Communicator, destroy_distributed, init_distributed
from spdkfac.support.jsonio import read_json, write_json

__all__ = ["PROBE_REPEATS", "PROBE_SIZES", "main", "measure_link", "probe_cluster"]

#: Message sizes (bytes) of the probe: start-up dominated (4 KiB) to rate dominated (16 MiB).
PROBE_SIZES: tuple[int, ...] = tuple(2**k for k in (12, 16, 18, 20, 22, 24))
#: Timed repeats per size (more below 1 MiB, see :func:`measure_collectives`).
PROBE_REPEATS = 3


def measure_link(
    comm: Communicator, sizes: Sequence[int] = PROBE_SIZES, repeats: int = PROBE_REPEATS
) -> LinkMeasurement:
    """Time all-reduce and broadcast of each size between the ranks (a collective).

    The calibration's own timing (:func:`~spdkfac.calibrate.measure_collectives`: a
    barrier before each repeat, the slowest rank's time, the median over repeats), so the
    label and the live cost model's fit are measured alike. Identical on every rank.

    Raises:
        ValueError: With one rank (there is no link), or on bad ``sizes`` or ``repeats``.
    """
    if comm.world_size < 2:
        raise ValueError(f"measuring a link needs >= 2 ranks, got world size {comm.world_size}")
    samples = measure_collectives(comm, sizes, repeats)
    return LinkMeasurement(
        world_size=comm.world_size,
        allreduce=tuple(samples.allreduce),
        broadcast=tuple(samples.broadcast),
    )


def probe_cluster(
    cluster: Cluster,
    *,
    timeout: float,
    sizes: Sequence[int] = PROBE_SIZES,
    port: int = MASTER_PORT + 1,
) -> LinkMeasurement | None:
    """Run :func:`main` on every rank of ``cluster`` (one process per namespace, as the
    benchmark's ranks run) and return what it measured.

    ``port`` (rank 0's store) differs from the benchmark's, and the second probe of a run
    takes another, so that no socket left in ``TIME_WAIT`` can keep ranks from meeting.

    Returns:
        The measurement; None when a probe rank failed or ``timeout`` passed (the
        launcher has then printed why).
    """
    ranks = len(cluster.namespaces)
    with tempfile.TemporaryDirectory(prefix="spdkfac-link-") as directory:
        out = Path(directory) / "link.json"
        argv = [sys.executable, "-m", "spdkfac.bench.linkprobe", "--out", str(out),
                "--timeout", str(timeout), "--sizes", ",".join(str(n) for n in sizes)]  # fmt: skip
        commands = rank_commands(argv, nproc=ranks, cluster=cluster, port=port)
        if run_ranks(commands, timeout) != 0 or not out.is_file():
            return None
        return LinkMeasurement.from_json(read_json(out, "link measurement"))


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of the probe: join the group the environment describes, measure, and
    (rank 0) write the measurement as JSON to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, s")
    parser.add_argument(
        "--sizes",
        type=lambda text: [int(size) for size in text.split(",")],
        default=list(PROBE_SIZES),
        help="comma list of message sizes in bytes",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = init_distributed("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        measurement = measure_link(comm, args.sizes)
        if comm.rank == 0:
            write_json(args.out, measurement.to_json(), indent=1)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure how gloo communication and computation slow each other on this machine.

Two ranks (loopback, or the emulated 1 Gbit/s cluster as root) time a block of
convolutions alone (T_p), an all-reduce alone (T_c), then both at once: the all-reduce is
launched and the same convolutions run while it moves. If the transfer ends at t_c' and
the computation at t_p', the simulator's knobs follow (see ``spdkfac.sim.engine``):
``overlap`` (the share of its rate a transfer keeps while the rank computes) and
``contention`` (the share of its speed the computation loses while the transfer moves),
from the ``u = min(t_c', t_p')`` seconds both ran: ``T_c = overlap·u + (t_c' − u)`` and
``t_p' − T_p = contention·u``. It also times posting one asynchronous all-reduce
(``issue_overhead_seconds``) and an 8 MiB all-reduce alone (``transfer_alone_s``, the
bandwidth the validation gives collectives). Knobs are means over ``--repeats`` rounds,
with their standard errors (``*_se``); how differently the two ranks are slowed in the
same round, relative to the mean, is the simulator's ``contention_spread``. The same rounds
with a broadcast from rank 0 instead of the all-reduce give ``broadcast_overlap`` and
``broadcast_contention`` (a broadcast reduces nothing, so it may cost the CPUs less). Rank 0
prints JSON and, with ``--out``, merges it into a file keyed by link.

    python benchmarks/sim/calibrate_sim_interference.py --link loopback \\
        --out benchmarks/reports/sim_interference_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.futures import Future

from spdkfac.bench.launch import free_port, run_ranks
from spdkfac.bench.netns import emulated_cluster
from spdkfac.comm import Communicator, barrier, destroy_distributed, init_distributed

#: Sized so that a transfer lasts about as long as the computation (~0.15 s here): the
#: knobs are then ratios of large differences, not of the computation's noise.
MESSAGE_BYTES = {"loopback": 128 * 2**20, "1gbit": 16 * 2**20}
#: All-reduce timed alone for the simulator's bandwidth: a factor bucket's size, and the
#: top of the range the runs fit their α-β on (4 KiB - 8 MiB).
BANDWIDTH_BYTES = 8 * 2**20
#: A broadcast moves each byte once (an all-reduce about twice): larger, for as long a transfer.
BROADCAST_BYTES = {"loopback": 256 * 2**20, "1gbit": 32 * 2**20}


def _compute(inputs: torch.Tensor, weight: torch.Tensor, count: int) -> None:
    x = inputs
    for _ in range(count):
        x = F.relu(F.batch_norm(F.conv2d(x, weight, padding=1), None, None, training=True))


def _rounds(
    comm: Communicator, collective: Callable[[], Future[torch.Tensor]], repeats: int
) -> dict[str, float]:
    """Medians of compute alone, ``collective`` alone, and both at once; the knobs."""
    inputs, weight = torch.randn(32, 64, 16, 16), torch.randn(64, 64, 3, 3) * 0.05
    rows: list[tuple[float, float, float, float]] = []
    for _ in range(repeats + 1):
        barrier(comm)
        start = time.perf_counter()
        _compute(inputs, weight, 25)
        alone_compute = time.perf_counter() - start
        barrier(comm)
        start = time.perf_counter()
        collective().wait()
        alone_transfer = time.perf_counter() - start
        barrier(comm)
        done: list[float] = []
        start = time.perf_counter()
        future = collective()
        future.add_done_callback(lambda _: done.append(time.perf_counter()))
        _compute(inputs, weight, 25)
        both_compute = time.perf_counter() - start
        future.wait()
        while not done:
            time.sleep(1e-4)
        rows.append((alone_compute, alone_transfer, both_compute, done[0] - start))
    rows = rows[1:]  # the first round warms up
    t_p, t_c, t_p2, t_c2 = (statistics.median(column) for column in zip(*rows, strict=True))
    # Knobs per round (each round's alone and together runs are a second apart, so slow
    # drifts of the machine cancel), then their means (the simulator predicts mean times;
    # per-round values spread widely on the shaped link) and the means' standard errors.
    # While both run (``under`` seconds) the transfer moves at ``overlap`` and the
    # computation at 1 − contention.
    overlaps, contentions = [], []
    for p, c, p2, c2 in rows:
        under = min(c2, p2)
        overlaps.append(min(1.0, max(0.0, (c - (c2 - under)) / under)))
        contentions.append(max(0.0, min(0.95, (p2 - p) / under)))
    # How differently the two ranks are slowed in the same round: what makes them drift
    # apart (the simulator draws each rank's contention independently, so the difference
    # of two draws has √2 times the spread of one).
    mine = torch.tensor(contentions, dtype=torch.float64)
    both = comm.all_gather(mine).wait()
    differences = (both[0] - both[1]).tolist()
    mean = float(torch.stack(both).mean())
    spread = statistics.stdev(differences) / 2**0.5 / mean if mean > 0 else 0.0
    return {
        "compute_alone_s": t_p,
        "interference_transfer_alone_s": t_c,
        "compute_with_transfer_s": t_p2,
        "interference_transfer_with_compute_s": t_c2,
        "overlap": statistics.fmean(overlaps),
        "contention": statistics.fmean(contentions),
        "overlap_se": statistics.stdev(overlaps) / len(rows) ** 0.5,
        "contention_se": statistics.stdev(contentions) / len(rows) ** 0.5,
        "contention_sd": statistics.stdev(contentions),
        "contention_spread": spread,
    }


def _worker(link: str, repeats: int) -> None:
    torch.set_num_threads(1)
    comm = init_distributed("gloo")
    message = torch.ones(MESSAGE_BYTES[link] // 4)
    try:
        reduce = _rounds(comm, lambda: comm.all_reduce_sum(message), repeats)
        sent = torch.ones(BROADCAST_BYTES[link] // 4)
        broadcast = _rounds(comm, lambda: comm.broadcast(sent, 0), repeats)
        bucket = torch.ones(BANDWIDTH_BYTES // 4)
        alone: list[float] = []
        for _ in range(repeats):
            barrier(comm)
            start = time.perf_counter()
            comm.all_reduce_sum(bucket).wait()
            alone.append(time.perf_counter() - start)
        issues: list[float] = []
        for _ in range(50):  # the host cost of posting an asynchronous collective
            small = torch.ones(1024)
            barrier(comm)
            start = time.perf_counter()
            future = comm.all_reduce_sum(small)
            issues.append(time.perf_counter() - start)
            future.wait()
        if comm.rank == 0:
            measured = {
                "link": link,
                "message_bytes": BANDWIDTH_BYTES,
                "transfer_alone_s": statistics.median(alone),
                "interference_bytes": MESSAGE_BYTES[link],
                **reduce,
            }
            measured["issue_overhead_seconds"] = statistics.median(issues)
            measured["broadcast_bytes"] = BROADCAST_BYTES[link]
            measured["broadcast_transfer_alone_s"] = broadcast["interference_transfer_alone_s"]
            measured["broadcast_overlap"] = broadcast["overlap"]
            measured["broadcast_contention"] = broadcast["contention"]
            measured["broadcast_overlap_se"] = broadcast["overlap_se"]
            measured["broadcast_contention_se"] = broadcast["contention_se"]
            measured["broadcast_contention_sd"] = broadcast["contention_sd"]
            measured["broadcast_contention_spread"] = broadcast["contention_spread"]
            print(json.dumps(measured), flush=True)
    finally:
        destroy_distributed()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", choices=tuple(MESSAGE_BYTES), default="loopback")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--out", default=None, help="JSON file to merge the result into")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.link, args.repeats)
        return 0
    argv = [sys.executable, __file__, "--worker", "--link", args.link]
    argv += ["--repeats", str(args.repeats)]
    result = Path(f"/tmp/spdkfac-interference-{os.getpid()}.json")
    base = {"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = ["sh", "-c", f'exec "$0" "$@" > {result}', *argv]
    if args.link == "loopback":
        port = str(free_port())
        code = run_ranks(
            [
                (
                    command if rank == 0 else argv,
                    {
                        **os.environ,
                        **base,
                        "RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port,
                    },
                )
                for rank in range(2)
            ],
            timeout=600,
        )
    else:
        with emulated_cluster(2, rate=args.link) as cluster:
            commands = []
            for rank in range(2):
                env = {**base, "RANK": str(rank), "MASTER_ADDR": cluster.addresses[0],
                       "MASTER_PORT": "29577", "GLOO_SOCKET_IFNAME": cluster.interfaces[rank],
                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # fmt: skip
                commands.append(
                    (cluster.command(rank, command if rank == 0 else argv, env), dict(os.environ))
                )
            code = run_ranks(commands, timeout=600)
    if code != 0:
        return code
    measured = json.loads(result.read_text().strip().splitlines()[-1])
    result.unlink()
    print(json.dumps(measured, indent=1))
    if args.out:
        target = Path(args.out)
        merged = json.loads(target.read_text()) if target.exists() else {}
        merged[args.link] = measured
        target.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

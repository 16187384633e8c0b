"""The timed DDP all-reduce hook: records every bucket's launch, averages like DDP."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac.comm import BucketLaunches, TorchDistributedCommunicator, timed_allreduce_hook


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 3))  # fmt: skip


def _train(rank: int, world_size: int) -> dict[str, object]:
    launches = BucketLaunches()
    # Small buckets, so one backward launches several all-reduces.
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.1)
    ddp.register_comm_hook(None, timed_allreduce_hook(launches))
    reference = _model()
    generator = torch.Generator().manual_seed(rank)
    windows, counts = [], []
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration
        inputs = torch.randn(8, 64, generator=generator)
        targets = torch.randint(0, 3, (8,), generator=generator)
        launches.clear()
        ddp.zero_grad()
        reference.zero_grad()
        began = time.perf_counter()
        F.cross_entropy(ddp(inputs), targets).backward()
        ended = time.perf_counter()
        F.cross_entropy(reference(inputs), targets).backward()
        windows.append((began, launches.last, ended))
        counts.append(sorted(index for index, _ in launches.times))
        # The hook must average exactly as DDP does without one.
        comm = TorchDistributedCommunicator()
        for mine, plain in zip(ddp.parameters(), reference.parameters(), strict=True):
            expected = comm.all_reduce_average(plain.grad.clone()).wait()
            torch.testing.assert_close(mine.grad, expected)
            plain.grad = None
    launches.clear()
    return {"windows": windows, "indices": counts, "after_clear": launches.last}


def test_timed_hook_records_every_bucket_launch_inside_backward() -> None:
    results = run_distributed(_train, 2)
    for result in results:
        assert result["after_clear"] is None
        for began, last, ended in result["windows"]:
            assert last is not None and began < last <= ended
        first, *rebuilt = result["indices"]
        assert first == [0]  # DDP's first bucket is 1 MB: one all-reduce
        for indices in rebuilt:
            assert len(indices) >= 2 and indices == list(range(len(indices)))
    assert results[0]["indices"] == results[1]["indices"]

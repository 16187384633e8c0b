"""Run a function on N gloo ranks in spawned processes, with a hard timeout and tracebacks."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]


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
                if process.is_alive():
                    process.kill()
                    process.join()
    errors = [f"--- rank {r} ---\n{p}" for r, (s, p) in sorted(outcomes.items()) if s == "error"]
    for rank in sorted(set(range(world_size)) - set(outcomes)):
        code = processes[rank].exitcode
        why = f"died with exit code {code}" if code not in (None, -9) else f"hung ({timeout} s)"
        errors.append(f"rank {rank} returned no result: {why}")
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]

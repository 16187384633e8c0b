"""The FSDP2 × TP projection as markdown (``spdkfac simulate --tp-size``): per strategy,
FSDP2's and FSDP2 × TP's iteration times, the parts FSDP2 × TP adds and the bytes each
rank sends (:mod:`spdkfac.sim.tensor_parallel`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spdkfac.sim.hardware import Hardware
from spdkfac.sim.simulator import StrategyResult
from spdkfac.sim.tensor_parallel import TensorParallelResult, tensor_parallel_result
from spdkfac.sim.workload import Workload

__all__ = ["tensor_parallel_section", "tensor_parallel_table"]


def tensor_parallel_table(rows: Sequence[tuple[str, TensorParallelResult]]) -> str:
    """A markdown table of labelled results: FSDP2 and FSDP2 × TP iteration times, the
    parts FSDP2 × TP adds and the bytes each rank sends under each."""
    lines = [
        "| strategy | FSDP2 ms | FSDP2 x TP ms | TP own ms | K-FAC capture ms "
        "| K-FAC grad reads ms | uneven factor split ms | FSDP2 MB/rank | FSDP2 x TP MB/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, result in rows:
        times = (
            result.fsdp.iteration_s,
            result.iteration_s,
            result.stream_s,
            result.capture_s,
            result.reads_s,
            result.factor_extra_s,
        )
        cells = " | ".join(f"{1e3 * value:.1f}" for value in times)
        lines.append(
            f"| {label} | {cells} | {result.fsdp.bytes_per_rank / 1e6:.1f} "
            f"| {result.bytes_per_rank / 1e6:.1f} |"
        )
    return "\n".join(lines)


def tensor_parallel_section(
    workload: Workload,
    hardware: Hardware,
    results: Mapping[str, StrategyResult],
    tp: int,
    factor_update_steps: int = 1,
) -> str:
    """A markdown section: labelled data-parallel ``results`` (one world size) of
    ``workload`` under FSDP2 × TP in groups of ``tp``, next to FSDP2 alone."""
    rows = [
        (
            label,
            tensor_parallel_result(
                ddp, workload, hardware, tp, factor_update_steps=factor_update_steps
            ),
        )
        for label, ddp in results.items()
    ]
    world = next(iter(results.values())).world_size
    title = f"FSDP2 x TP: {workload.model}, {world} workers ({tp}-rank TP groups)"
    return f"\n\n## {title}\n\n{tensor_parallel_table(rows)}"

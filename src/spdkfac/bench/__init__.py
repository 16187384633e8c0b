"""``spdkfac bench``: variants side by side on emulated clusters, with the paper's breakdowns."""

from __future__ import annotations

from spdkfac.bench.results import BenchResults, VariantResult
from spdkfac.bench.runner import BenchOptions, run_worker
from spdkfac.bench.variants import PRESETS, VARIANTS, Variant, parse_variants

__all__ = [
    "PRESETS",
    "VARIANTS",
    "BenchOptions",
    "BenchResults",
    "Variant",
    "VariantResult",
    "parse_variants",
    "run_worker",
]

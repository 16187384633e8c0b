"""The user docs point at files that exist: every `benchmarks/...` or `scripts/...` path
quoted in README.md, docs/*.md and benchmarks/README.md (so every `python benchmarks/X.py`
or `bash scripts/Y.sh` command they quote), and every relative markdown link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")]
)
#: A quoted path: starts at a word boundary that is not part of a longer path or of a
#: `git show COMMIT:path` reference (a retired file, held by that commit only).
QUOTED = re.compile(r"(?<![\w/:.-])((?:benchmarks|scripts)/[\w./*+-]*[\w*])")
#: Paths the pages name as where a future run's files go (docs/gpu.md: a GPU run's report).
NOT_YET_WRITTEN = {"benchmarks/reports/gpu_h200.md", "benchmarks/reports/costmodel_h200.json"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def quoted_paths(text: str) -> list[str]:
    """The `benchmarks/...` and `scripts/...` paths quoted in ``text``."""
    return [match.group(1) for match in QUOTED.finditer(text)]


def _exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def _relative_links(page: Path) -> list[str]:
    links = [m.group(1).split("#")[0] for m in LINK.finditer(page.read_text())]
    return [link for link in links if link and "://" not in link and not link.startswith("mailto:")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_path_exists(page: Path) -> None:
    missing = [
        path
        for path in quoted_paths(page.read_text())
        if not _exists(path) and path not in NOT_YET_WRITTEN
    ]
    assert not missing, f"{page.relative_to(ROOT)} quotes missing paths: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    missing = [link for link in _relative_links(page) if not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_extraction_sees_commands_and_skips_retired_files() -> None:
    text = (
        "run `python benchmarks/perf/bench_step.py --threads 1`, then `bash "
        "scripts/ensure_gcide.sh`; see benchmarks/reports/soak.md. Retired: "
        "`git show 575d9b8:benchmarks/pilot_text_kfac.sh`."
    )
    assert quoted_paths(text) == [
        "benchmarks/perf/bench_step.py",
        "scripts/ensure_gcide.sh",
        "benchmarks/reports/soak.md",
    ]
    assert not _exists("benchmarks/pilot_text_kfac.sh")  # the check can fail

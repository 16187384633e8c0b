"""The user docs point at files that exist: every `benchmarks/...` or `scripts/...` path
quoted in README.md, docs/*.md and benchmarks/README.md (so every `python benchmarks/X.py`
or `bash scripts/Y.sh` command they quote), and every relative markdown link (its file,
and the heading it points at)."""

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
    links = [m.group(1) for m in LINK.finditer(page.read_text())]
    return [link for link in links if "://" not in link and not link.startswith("mailto:")]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page`` (lower case, punctuation dropped,
    spaces to hyphens; a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    for line in page.read_text().splitlines():
        if re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


def _broken(page: Path, link: str) -> bool:
    path, _, anchor = link.partition("#")
    target = page.parent / path if path else page
    if not target.exists():
        return True
    return bool(anchor) and target.suffix == ".md" and anchor not in anchors(target)


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
    missing = [link for link in _relative_links(page) if _broken(page, link)]
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


def test_anchors_follow_githubs_rule(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text('# Top\n\n## `strategy="auto"` against it\n\n## Osawa et al.\'s way\n## Top\n')
    assert anchors(page) == {"top", "strategyauto-against-it", "osawa-et-als-way", "top-1"}
    assert _broken(page, "#nowhere") and not _broken(page, "#top-1")

"""`make demo` fetches only what the demo reads (Debian's Fashion-MNIST); the text corpora
come with `make corpora`, and GCIDE's data file without the dictd server its package
depends on. Read from `make -n` (nothing runs) and each script's `--print-packages`."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = re.compile(r"\bbash (scripts/[\w.-]+\.sh)")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def packages(target: str) -> set[str]:
    """The Debian packages the data scripts of ``make TARGET`` would fetch."""
    plan = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True).stdout  # fmt: skip
    found: set[str] = set()
    for script in SCRIPT.findall(plan):
        command = ["bash", script, "--print-packages"]
        printed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                                 check=True)  # fmt: skip
        found.update(printed.stdout.split())
    return found


def test_the_demo_fetches_only_fashion_mnist() -> None:
    assert packages("data") == {"dataset-fashion-mnist"}
    assert packages("demo") == {"dataset-fashion-mnist"}


def test_the_corpora_come_with_their_own_target() -> None:
    assert packages("corpora") == {"fortunes", "dict-gcide"}


def test_gcide_is_unpacked_not_installed() -> None:
    code = [
        line
        for line in (ROOT / "scripts" / "ensure_gcide.sh").read_text().splitlines()
        if not line.lstrip().startswith("#")
    ]
    assert not [line for line in code if "apt-get install" in line]
    assert any("apt-get download" in line for line in code)
    assert any("dpkg-deb -x" in line for line in code)

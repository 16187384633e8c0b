"""Simulate a broken or missing optional package for the duration of one test."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

import spdkfac.support.optional

__all__ = ["ALL_OPTIONAL", "ERRORS", "break_packages"]

#: Every optional package spdkfac imports (their import names).
ALL_OPTIONAL: tuple[str, ...] = ("torchvision", "matplotlib", "PIL", "tensorboard", "yaml")

#: How a package fails: as PyPI's torchvision beside the CPU torch wheel, or as a missing one.
ERRORS: dict[str, str] = {
    "RuntimeError": 'raise RuntimeError("operator {name}::nms does not exist")\n',
    "ImportError": 'raise ImportError("No module named {name!r}", name={name!r})\n',
}


def break_packages(
    monkeypatch: pytest.MonkeyPatch, root: Path, names: Iterable[str], error: str
) -> None:
    """Make every ``import <name>`` (and its submodules) raise ``error`` until the test ends.

    Writes ``root/<name>/__init__.py`` raising it, puts ``root`` first on ``sys.path``,
    drops already imported copies from ``sys.modules`` (restored afterwards) and gives
    :mod:`spdkfac.support.optional` an empty failure cache (the old one comes back afterwards).
    """
    chosen = set(names)
    for name in chosen:
        package = root / name
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(ERRORS[error].format(name=name))
    monkeypatch.syspath_prepend(str(root))
    for module in list(sys.modules):
        top = module.split(".")[0]
        if top in chosen or (
            "tensorboard" in chosen and module.startswith("torch.utils.tensorboard")
        ):
            monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(spdkfac.support.optional, "_failures", {})

"""The package keeps its shape: scripts/check_shape.py finds no function over 60 lines or
8 parameters, no module over 400 lines, at most one comparison with ``"auto"``, at most 10
modules at the root and no import up a floor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_shape.py"


def _check_shape():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_shape", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_shape"] = module
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_shape_violation() -> None:
    found = _check_shape().measure()
    assert {kind: items for kind, items in found.items() if items} == {}


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    check = _check_shape()
    package = tmp_path / "spdkfac"
    (package / "engine").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (package / "engine" / "long.py").write_text(
        f"from spdkfac.cli import main\n\n\ndef f(a, b, c, d, e, f, g, h, i):\n{body}\n"
        "    return a == 'auto' or b == 'auto'\n"
    )
    check.ROOT = package
    found = check.measure()
    assert found["long functions"] and found["long signatures"]
    assert found["auto comparisons"] and found["upward imports"]

"""Measure the package's shape: long functions, long signatures, ``"auto"`` string tests,
modules at the package root, long modules and upward imports.

Usage: ``python scripts/check_shape.py [--strict]`` (``--strict`` exits 1 on a violation).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "spdkfac"
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8
MAX_AUTO_COMPARISONS = 1
MAX_ROOT_MODULES = 10
MAX_MODULE_LINES = 400
#: The package's floors, lowest first: a module may import only from lower floors (and
#: from its own package). docs/architecture.md draws the same picture.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("types",),
    ("support",),
    ("linalg", "costmodel", "profiling", "layers", "schedules", "data", "models"),
    ("forms",),
    ("planning",),
    ("comm",),
    ("layout",),
    ("curvature",),
    ("strategies",),
    ("config",),
    ("engine",),
    ("preconditioner", "calibrate"),
    ("sim", "training"),
    ("bench", "optim"),
    ("cli", "__init__"),
    ("__main__",),
)
#: The CLI's argument-parser builders are exempt from the function-length limit.
PARSER_BUILDERS = ("cli/",)


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function without its docstring."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        doc = body[0]
        doc_lines = (doc.end_lineno or doc.lineno) - doc.lineno + 1
    else:
        doc_lines = 0
    return (node.end_lineno or node.lineno) - node.lineno + 1 - doc_lines


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def _is_parser_builder(path: str, name: str) -> bool:
    return path.startswith(PARSER_BUILDERS) and ("parser" in name or name.startswith("add_"))


def _upward(rel: str, node: ast.ImportFrom, floor: dict[str, int]) -> list[str]:
    """The imports of ``node`` (in module ``rel``) that reach a floor above its own."""
    unit = Path(rel).with_suffix("").parts[0]
    parts = (node.module or "").split(".")
    targets = [alias.name for alias in node.names] if len(parts) == 1 else [parts[1]]
    return [
        f"{rel}:{node.lineno} {unit} -> {target}"
        for target in targets
        if target != unit and target in floor and floor[target] >= floor[unit]
    ]


def measure() -> dict[str, list[str]]:
    """Every violation, by kind."""
    found: dict[str, list[str]] = {
        "long functions": [],
        "long signatures": [],
        "auto comparisons": [],
        "long modules": [],
        "root modules": [],
        "upward imports": [],
    }
    floor = {unit: level for level, units in enumerate(FLOORS) for unit in units}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found["long modules"].append(f"{rel}: {lines} lines")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{rel}:{node.lineno} {node.name}"
                length = _body_lines(node)
                if length > MAX_FUNCTION_LINES and not _is_parser_builder(rel, node.name):
                    found["long functions"].append(f"{where}: {length} lines")
                count = _parameters(node)
                if count > MAX_PARAMETERS:
                    found["long signatures"].append(f"{where}: {count} parameters")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spdkfac"):
                found["upward imports"].extend(_upward(rel, node, floor))
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value == "auto" for o in operands):
                    found["auto comparisons"].append(f"{rel}:{node.lineno}")
    units = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    found["upward imports"].extend(
        f"{unit}: on no floor" for unit in sorted(units - set(floor) - {"__pycache__"})
    )
    root = [p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    if len(root) > MAX_ROOT_MODULES:
        found["root modules"] = sorted(root)
    if len(found["auto comparisons"]) <= MAX_AUTO_COMPARISONS:
        found["auto comparisons"] = []
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 on any violation")
    args = parser.parse_args()
    found = measure()
    for kind, items in found.items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if args.strict and any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every recipe of docs/integrations.md is the marked part of a test here, word for word."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PAGE = HERE.parents[1] / "docs" / "integrations.md"
REGION = re.compile(r"# --8<-- \[start:([\w-]+)\]\n(.*?)^\s*# --8<-- \[end:\1\]", re.S | re.M)


def _regions() -> list[tuple[str, str]]:
    found = []
    for path in sorted(HERE.glob("test_*.py")):
        for name, body in REGION.findall(path.read_text()):
            recipe = textwrap.dedent(body).replace("  # fmt: skip", "").rstrip()
            found.append((f"{path.name}:{name}", recipe))
    return found


def test_every_host_has_a_recipe() -> None:
    assert {label.split(":")[1] for label, _ in _regions()} == {
        "hf", "lightning", "accelerate", "accelerate-ddp-first", "accelerate-resume",
        "torchtitan",
    }  # fmt: skip


@pytest.mark.parametrize(("label", "recipe"), _regions(), ids=[r[0] for r in _regions()])
def test_recipe_is_in_the_page(label: str, recipe: str) -> None:
    assert f"```python\n{recipe}\n```" in PAGE.read_text(), f"{label} differs from the page"

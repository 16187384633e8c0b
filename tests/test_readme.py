"""The README as a new user reads it: short, its Python quick start runs as written (on a
tiny model and data), and every ``spdkfac`` command in it is one the CLI accepts whole
(flags parsed and the run's configuration built, so none is refused at start)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

from spdkfac.cli.main import build_parser
from spdkfac.cli.train import _config_from_args

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang == language]


def test_the_readme_reads_in_five_minutes() -> None:
    assert len(README.read_text().splitlines()) <= 120


def test_the_quick_start_runs_as_written() -> None:
    (code,) = [block for block in _blocks("python") if "KFACPreconditioner(" in block]
    torch.manual_seed(0)
    loader = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    scope = {"MyNet": lambda: net, "loader": loader}
    before = [p.detach().clone() for p in net.parameters()]
    exec(compile(code, str(README), "exec"), scope)
    assert scope["precond"].layers == ["0", "2"]
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def _commands() -> list[list[str]]:
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("spdkfac"):
                commands.append(words[1:])
    return commands


def test_the_readme_has_a_cli_command() -> None:
    assert _commands()


@pytest.mark.parametrize("words", _commands(), ids=" ".join)
def test_every_cli_command_is_accepted(words: list[str]) -> None:
    args = build_parser().parse_args(words)
    if words[0] == "train":
        config = _config_from_args(args)
        assert config.optimizer == words[words.index("--optimizer") + 1]

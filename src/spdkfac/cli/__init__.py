"""Command-line interface: ``spdkfac demo`` (more verbs arrive with later releases)."""

from __future__ import annotations

from spdkfac.cli.main import build_parser, main

__all__ = ["build_parser", "main"]

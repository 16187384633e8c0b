"""``python -m spdkfac VERB``: the command-line interface."""

from __future__ import annotations

from spdkfac.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

"""``spdkfac train --config`` files (TOML or YAML) and the TOML a run's ``config.toml`` is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spdkfac.support.optional import (
    OptionalPackageError,
    install_hint,
    optional_import,
    require,
    unavailable_reason,
)

__all__ = ["load_config_file", "toml_value"]


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file of training options.

    Raises:
        FileNotFoundError: The file does not exist (the message names it).
        ValueError: It cannot be parsed, or YAML is asked for without PyYAML installed.
    """
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"config file {source} does not exist")
    text = source.read_text()
    try:
        if source.suffix in (".yaml", ".yml"):
            try:
                yaml = require("yaml", "a YAML config file")
            except OptionalPackageError as error:
                raise ValueError(f"{source}: {error}") from None
            loaded = yaml.safe_load(text) or {}
        else:
            loaded = _parse_toml(text)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(f"{source}: cannot be parsed ({error})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{source}: expected a table of options, got {type(loaded).__name__}")
    return {str(key).replace("-", "_"): value for key, value in loaded.items()}


def _parse_toml(text: str) -> Any:
    # tomllib is in the standard library from Python 3.11; tomli is its 3.10 backport.
    for name in ("tomllib", "tomli"):
        module = optional_import(name)
        if module is not None:
            return module.loads(text)
    raise ValueError(
        f"TOML configs on Python 3.10 need tomli ({unavailable_reason('tomli')}): "
        f"{install_hint('tomli')}"
    )


def toml_value(value: Any) -> str:
    """``value`` (a bool, number, string or list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

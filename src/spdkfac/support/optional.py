"""Optional packages: imported where present, reported clearly where a feature needs them.

Every import of an optional package (torchvision, matplotlib, Pillow, tensorboard, PyYAML,
tomli) goes through :func:`optional_import`, which turns *any* failure to import into "not
available" and keeps the reason. A broken install counts as an absent one: PyPI's
torchvision beside the CPU torch wheel raises ``RuntimeError: operator torchvision::nms
does not exist`` on import, and that must not break a feature that never needed it.

Features that cannot work without the package call :func:`require` (a clear
:class:`OptionalPackageError` naming the package and how to install it); features that can
be skipped call :func:`optional_import` and print :func:`skip_notice`.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

__all__ = [
    "OPTIONAL_PACKAGES",
    "OptionalPackageError",
    "clear_cache",
    "import_failure",
    "install_hint",
    "optional_import",
    "require",
    "skip_notice",
    "unavailable_reason",
]

#: Optional packages: import name -> (distribution name, pip name). What each enables is
#: listed in docs/install.md.
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "torchvision": ("torchvision", "torchvision"),
    "matplotlib": ("matplotlib", "matplotlib"),
    "PIL": ("Pillow", "pillow"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "torch.utils.tensorboard": ("tensorboard", "tensorboard"),
    "yaml": ("PyYAML", "pyyaml"),
    "tomli": ("tomli", "tomli"),
}

_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# Import name -> "ExceptionType: message" of its last failed import.
_failures: dict[str, str] = {}


class OptionalPackageError(ImportError, ValueError):
    """A feature was asked for whose optional package is missing or fails to import.

    Both an ``ImportError`` (what is missing is a package) and a ``ValueError`` (the
    option that asked for it cannot be honoured), so command-line verbs that report bad
    options report this one the same way.
    """


def _package(name: str) -> tuple[str, str]:
    """(distribution, pip name) of an import name: the longest listed dotted prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        entry = OPTIONAL_PACKAGES.get(".".join(parts[:end]))
        if entry is not None:
            return entry
    return parts[0], parts[0]


def clear_cache() -> None:
    """Forget every recorded import failure (the next call tries to import again)."""
    _failures.clear()


def optional_import(name: str) -> ModuleType | None:
    """The module ``name`` (dotted names allowed), or None when it cannot be imported.

    Any exception raised while importing counts as "not available", not only
    ``ImportError``; the reason is kept for :func:`unavailable_reason`. A failure is
    remembered, so a broken package is not imported again on every call, unless the module
    has since appeared in ``sys.modules``.

    Args:
        name: Import name, e.g. ``"matplotlib.figure"`` or ``"torchvision.models"``.

    Returns:
        The module, or None.
    """
    if name in _failures and name not in sys.modules:
        return None
    try:
        # ``__import__`` with a fromlist returns the submodule itself.
        module = __import__(name, fromlist=["__name__"])
    except Exception as error:  # a broken install is an absent one
        _failures[name] = f"{type(error).__name__}: {error}"
        return None
    _failures.pop(name, None)
    return module


def import_failure(name: str) -> str | None:
    """``"ExceptionType: message"`` of the last failed import of ``name``, or None."""
    return _failures.get(name)


def unavailable_reason(name: str) -> str:
    """Why ``name`` is not available, e.g. ``"matplotlib is not installed"``."""
    distribution, _ = _package(name)
    failure = _failures.get(name)
    if failure is None or failure.startswith(("ImportError", "ModuleNotFoundError")):
        return f"{distribution} is not installed"
    return f"{distribution} is installed but fails to import ({failure})"


def install_hint(name: str) -> str:
    """How to install the package behind ``name`` without replacing the installed torch.

    For torchvision the hint pins torch and names the matching torchvision release (and,
    for a CPU torch build, the CPU wheel index): PyPI's default torchvision wheel fails to
    import beside the CPU torch wheel.
    """
    distribution, pip_name = _package(name)
    if distribution != "torchvision":
        return f"pip install {pip_name}"
    installed = torch.__version__
    release, _, local = installed.partition("+")
    try:
        major, minor = (int(part) for part in release.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if major != 2:
        return f"install a torchvision built for the installed torch {installed}"
    index = f" --index-url {_CPU_INDEX}" if local == "cpu" else ""
    return (
        f"install a torchvision built for the installed torch {installed}, keeping torch "
        f"pinned: pip install torch=={release} torchvision==0.{minor + 15}.*{index}"
        " (PyPI's default torchvision wheel fails to import beside the CPU torch wheel)"
    )


def require(name: str, feature: str) -> ModuleType:
    """The module ``name``, or a clear error saying that ``feature`` needs its package.

    Args:
        name: Import name, e.g. ``"yaml"``.
        feature: What needs it, e.g. ``"a YAML config file"``.

    Returns:
        The module.

    Raises:
        OptionalPackageError: It cannot be imported; the message names the feature, the
            package, why it is unavailable and how to install it.
    """
    module = optional_import(name)
    if module is None:
        distribution, _ = _package(name)
        raise OptionalPackageError(
            f"{feature} needs the {distribution} package ({unavailable_reason(name)}): "
            f"{install_hint(name)}"
        )
    return module


def skip_notice(name: str, skipped: str) -> str:
    """One line for a feature skipped because ``name`` is unavailable.

    Example: ``"breakdown.png skipped: matplotlib is not installed (pip install matplotlib)"``.
    """
    return f"{skipped} skipped: {unavailable_reason(name)} ({install_hint(name)})"

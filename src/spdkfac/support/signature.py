"""A constructor's signature that lists an options dataclass's fields as keywords."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

__all__ = ["signature_with_options"]


def signature_with_options(init: Callable[..., None], options: Any) -> inspect.Signature:
    """``init``'s signature with its ``**options`` replaced by every field of the
    dataclass ``options`` as a keyword, after its first parameter (for ``help()``, IDEs
    and ``inspect``; the fields stay defined once, in the dataclass)."""
    own = inspect.signature(init).parameters
    options = [
        inspect.Parameter(
            option.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=option.default
            if option.default is not MISSING
            else option.default_factory()
            if option.default_factory is not MISSING
            else inspect.Parameter.empty,
            annotation=option.type,
        )
        for option in fields(options)
    ]
    runtime = [
        parameter
        for name, parameter in own.items()
        if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    return inspect.Signature([runtime[0], *options, *runtime[1:]])

"""The preconditioner's state as ``torch.distributed.checkpoint`` (DCP) state: keyed by
module names, each rank holding only what it keeps (under ``osawa`` its owned layers), and
a fresh preconditioner's template of allocated tensors to load into.

Layout of :func:`dcp_state` (nested dicts; DCP flattens them to dotted keys)::

    {"meta": "<json: format, counters, forward order, inverse form, auto, signature>",
     "<section key>": {"<module name>": {"<entry>": tensor, ..., "present": uint8[n]}}}

Every entry of a held block is a tensor (float64 zeros where the block has none yet);
``present`` says, in ``state_shapes()`` order, which are real, so None-ness survives, and
a JSON ``dtypes`` string per block records their dtypes. A fresh preconditioner's state is
thus the template to load into: all float64 zeros, into which any saved float dtype
converts exactly; :func:`from_dcp` casts each back to its recorded dtype, so the bits are
the saved ones. Keys of blocks one rank holds exist on that rank only: DCP writes them
from there, and each rank reads only the blocks it holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from spdkfac.curvature import CurvatureBlock
from spdkfac.curvature.block import STATE_SECTIONS

__all__ = ["dcp_state", "from_dcp"]

_PRESENT = "present"
#: Each held block's JSON ``{entry: dtype}`` of its real entries (per owner, like its tensors).
_DTYPES = "dtypes"


def _section_of(block: CurvatureBlock) -> str:
    return block.section.key


def _signature(blocks: Sequence[CurvatureBlock]) -> dict[str, dict[str, list[int]]]:
    return {
        f"{_section_of(b)}/{b.name}": {k: list(s) for k, s in b.state_shapes().items()}
        for b in blocks
    }


def _tensors(block: CurvatureBlock, inverses: bool) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A held block's entries as tensors (zeros where None) with ``present``, and the
    dtype of each real one."""
    state = block.state()
    out: dict[str, Tensor] = {}
    dtypes: dict[str, str] = {}
    flags = []
    for key, shape in block.state_shapes().items():
        value = state.get(key)
        if value is not None and key.endswith("inverse") and not inverses:
            value = None
        flags.append(value is not None)
        if value is None:
            out[key] = torch.zeros(shape, dtype=torch.float64, device=block.device)
        else:
            out[key] = value.detach().clone()
            dtypes[key] = str(value.dtype).removeprefix("torch.")
    out[_PRESENT] = torch.tensor(flags, dtype=torch.uint8, device=block.device)
    return out, dtypes


def dcp_state(
    blocks: Sequence[CurvatureBlock],
    held: Sequence[CurvatureBlock],
    meta: dict[str, Any],
    *,
    inverses: bool = True,
) -> dict[str, Any]:
    """This rank's DCP state: ``held`` blocks' tensors, ``meta`` (counters, forward
    order...) and the signature of all ``blocks`` as one JSON string. No collective."""
    result: dict[str, Any] = {}
    for block in held:
        tensors, dtypes = _tensors(block, inverses)
        entry: dict[str, Any] = {**tensors, _DTYPES: json.dumps(dtypes, sort_keys=True)}
        result.setdefault(_section_of(block), {})[block.name] = entry
    result["meta"] = json.dumps({**meta, "signature": _signature(blocks)}, sort_keys=True)
    return result


def _check_signature(saved: Mapping[str, Any], blocks: Sequence[CurvatureBlock]) -> None:
    here = _signature(blocks)
    if saved == here:
        return
    missing = sorted(set(here) - set(saved))
    extra = sorted(set(saved) - set(here))
    shapes = sorted(k for k in set(here) & set(saved) if here[k] != saved[k])
    raise ValueError(
        "the DCP state is of another model: layers missing from it "
        f"{missing}, unexpected {extra}, with other factor shapes {shapes}"
    )


def _entry(block: CurvatureBlock, loaded: Mapping[str, Any] | None) -> dict[str, Tensor | None]:
    keys = list(block.state_shapes())
    if loaded is None:  # another rank's: dropped after the load
        return dict.fromkeys(keys)
    flags = loaded[_PRESENT].tolist()
    dtypes = json.loads(loaded[_DTYPES])
    return {
        key: loaded[key].to(getattr(torch, dtypes[key])) if flag else None
        for key, flag in zip(keys, flags, strict=True)
    }


def from_dcp(state: Mapping[str, Any], blocks: Sequence[CurvatureBlock]) -> dict[str, Any]:
    """The ordinary state dict of a DCP state ``dcp.load`` filled into
    :func:`dcp_template` (blocks this rank did not load come as None).

    Raises:
        ValueError: When the state is not a preconditioner's DCP state or is of another
            model.
    """
    meta = state.get("meta")
    if not isinstance(meta, str):
        raise ValueError("not a preconditioner's DCP state (no 'meta' string)")
    saved = json.loads(meta)
    _check_signature(saved["signature"], blocks)
    result: dict[str, Any] = {
        key: saved[key] for key in ("format", "steps", "skipped_steps", "forward_order")
    }
    result["inverse_form"] = saved["inverse_form"]
    if saved.get("auto") is not None:
        result["auto"] = saved["auto"]
    for section in STATE_SECTIONS:
        members = [b for b in blocks if b.section == section]
        if not members and not section.primary:
            continue
        loaded = state.get(section.key, {})
        entries = {b.name: _entry(b, loaded.get(b.name)) for b in members}
        result[section.key] = section.pack(entries, saved.get("norm_mode"))
    return result

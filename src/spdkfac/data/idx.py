"""Reader for the IDX binary format used by MNIST and Fashion-MNIST."""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np

__all__ = ["read_idx"]

# IDX type codes (third magic byte) → big-endian numpy dtypes.
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: Path | str) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a native-endian array.

    The header is two zero bytes, a type code, the number of dimensions, then one
    big-endian uint32 per dimension; the data follows in big-endian C order. Compression is
    detected from the gzip magic bytes, not the file name.

    Args:
        path: File to read.

    Returns:
        A writable array with the file's shape and dtype (e.g. ``uint8`` for images).

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is truncated, has trailing bytes, a bad magic number, or is
            a corrupt gzip stream. The message names the file.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip stream ({exc})") from exc
    return _parse_idx(raw, path)


def _parse_idx(raw: bytes, path: Path) -> np.ndarray:
    if len(raw) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(raw)} bytes)")
    zero0, zero1, type_code, ndim = raw[:4]
    if zero0 != 0 or zero1 != 0 or type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: bad IDX magic number 0x{raw[:4].hex()}")
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} < {header_size} bytes)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = header_size + math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        kind = "truncated" if len(raw) < expected else "has trailing bytes"
        raise ValueError(
            f"{path}: IDX data {kind}: {len(raw)} bytes, expected {expected} for shape {shape}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape)
    # astype copies, which both fixes the byte order and makes the array writable.
    return data.astype(dtype.newbyteorder("="))

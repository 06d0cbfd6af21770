"""A safetensors header checked as the ``safetensors`` library checks it, before any weight is read:
every entry an object with a known ``dtype``, a ``shape`` of non-negative integers and
``data_offsets`` inside the data section, spanning exactly shape × dtype size, no two spans
overlapping. Each refusal is a ``ModelSourceError`` naming the file, the tensor and the field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from bootstrap.config import is_int
from bootstrap.engine.models.files import ModelSourceError

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def check_header(file: Path, header: Any, data_bytes: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, dtype, shape, first byte in the data section) of every tensor of ``header``."""
    if not isinstance(header, dict):
        raise ModelSourceError(f"{file}: the header must be a JSON object, got {type(header).__name__}")
    out = []
    for name, entry in header.items():
        if name != "__metadata__":
            out.append(_entry(file, name, entry, data_bytes))
    reach, last = 0, ""  # the furthest end so far, and whose it is
    for begin, end, name in sorted((begin, begin + _nbytes(dtype, shape), name) for name, dtype, shape, begin in out):
        if begin < reach and begin < end:
            raise ModelSourceError(
                f"{file}: tensors {last!r} and {name!r} share bytes {begin}..{min(end, reach)} of the data"
            )
        if end > reach:
            reach, last = end, name
    return out


def _entry(file: Path, name: str, entry: Any, data_bytes: int) -> tuple[str, str, tuple[int, ...], int]:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ModelSourceError(f"{where} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise ModelSourceError(f"{where}: field 'dtype' must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        raise ModelSourceError(f"{where}: field 'shape' must be a list of integers >= 0, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(n) for n in offsets):
        raise ModelSourceError(f"{where}: field 'data_offsets' must be [begin, end] (integers), got {offsets!r}")
    begin, end = offsets
    need = _nbytes(dtype, shape)
    if not 0 <= begin <= end <= data_bytes or end - begin != need:
        raise ModelSourceError(
            f"{where} of shape {shape} {dtype} ({need} bytes): field 'data_offsets' {offsets} must span that many "
            f"bytes within the data section (0..{data_bytes})"
        )
    return name, dtype, tuple(shape), begin


def _nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize

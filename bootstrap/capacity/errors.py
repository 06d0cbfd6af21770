"""What every part of the capacity math shares: the error, byte formatting, argument checks."""

from __future__ import annotations

GIB = 1024**3


class CapacityError(ValueError):
    """The configuration cannot fit; the message gives the figures and the knob to turn."""


def fmt_bytes(n: int | float) -> str:
    """``12.34 GiB (13,249,974,108 bytes)``: both the readable and the exact figure."""
    return f"{n / GIB:.2f} GiB ({int(n):,} bytes)"


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_positive(**values: int | float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")

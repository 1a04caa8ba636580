"""Byte counts as people read them and write them. No torch here: the config checks use it before anything
heavy loads.

A size is written the same way wherever a key takes one (``ckpt.budget``, ``ckpt.memory``): a number and a
unit, in any case, with or without a space between them (``2GiB``, ``'2 GiB'``, ``300MB``, ``1.5gb``).
"""

from __future__ import annotations

import re

__all__ = ["LEAST_TYPED_BYTES", "SIZE_UNITS", "format_bytes", "parse_size"]

# What a size's unit may be, as an error says it.
SIZE_UNITS = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), in any case"
# A typed integer below 1 MiB is taken for a slip ("2" for 2 GB), not a byte count: each key that takes a size
# refuses one in a config or on a command line, and asks for a unit (or B, where bytes are meant).
LEAST_TYPED_BYTES = 2**20

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)$", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """The bytes of a size written as a number and a unit (``"2GiB"``, ``"2 gib"``, ``"1.5GB"``), rounded down;
    None where ``text`` is not one (a bare number, a sign, an unknown unit), for the caller to name its key.

    Zero is returned as zero (``"0GiB"``, ``"0.1B"``): whether that may be is the caller's to say.
    """
    match = _SIZE.match(text.strip())
    return None if match is None else int(float(match[1]) * _UNITS[match[2].lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

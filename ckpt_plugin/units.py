"""Byte counts as people read them. No torch here: the config checks use it before anything heavy loads."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

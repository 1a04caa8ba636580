"""The values of ``ckpt`` keys that are judged on their own, before any model: a segments value and a
torch.compile backend's name. The engine reads them the same way (``engine/sequential.py``,
``engine/regional.py``), so they are written here, below it, once."""

from __future__ import annotations

from typing import Any

from ckpt_plugin.errors import Problem

SEGMENT_WORDS = ("sqrt", "recursive", "optimal")
DEFAULT_BACKEND = "inductor"  # what ckpt.compile=true means: torch.compile's own default


def segment_problems(segments: Any, key: str = "ckpt.segments") -> list[Problem]:
    """What is wrong with a ``segments`` value on its own (not knowing the chain's length)."""
    if segments is None or segments in SEGMENT_WORDS:
        return []
    if isinstance(segments, bool) or not isinstance(segments, int):
        return [Problem(
            key,
            f"{key}={segments!r} ({type(segments).__name__}) must be an integer >= 1, "
            f"'sqrt', 'recursive' or 'optimal' (or null for one checkpoint per layer)",
        )]
    if segments < 1:
        return [Problem(
            key, f"{key}={segments} must be >= 1: the number of checkpointed segments (or 'sqrt', 'recursive')"
        )]
    return []


def backends() -> list[str]:
    """Every backend ``torch.compile(backend=...)`` accepts by name, debug ones (``aot_eager``) included."""
    import torch  # only when a backend's name is judged: the schema loads no framework at import

    return torch.compiler.list_backends(exclude_tags=())


def backend_of(value: bool | str) -> str | None:
    """The backend a validated ``ckpt.compile`` value asks for: true is inductor, false is None."""
    if value is True:
        return DEFAULT_BACKEND
    return value or None


__all__ = ["DEFAULT_BACKEND", "SEGMENT_WORDS", "backend_of", "backends", "segment_problems"]

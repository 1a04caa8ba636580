"""What a checkpoint's recorded ckpt keys say against this run's: each change, as a resume warns of it."""

from __future__ import annotations

from typing import Any


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key old -> new`` for each key whose value differs; a key one side lacks (another mode's) is (unset)."""
    unset = object()
    changes = []
    for key in dict.fromkeys([*current, *saved]):
        old, new = saved.get(key, unset), current.get(key, unset)
        if old != new and not (None in (old, new) and unset in (old, new)):  # a null that one mode lacks: no change
            changes.append(f"{key} {_shown(old, unset)} -> {_shown(new, unset)}")
    return changes


def _shown(value: Any, unset: object) -> str:
    if value is unset:
        return "(unset)"
    if isinstance(value, list) and len(value) == 1:
        return repr(value[0])  # layers=Block is stored as ['Block']
    return repr(value)


__all__ = ["config_changes"]

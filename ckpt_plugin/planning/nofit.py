"""What a planner answers when no plan of its kind fits a budget: a value, not an exception.

``ckpt=auto`` asks its strategies in turn (``apply/auto.py``) and words the refusal
once, from the one that reaches lowest (``config.budget.cannot_meet``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoFit:
    """No plan fits ``budget_bytes``; the least activation peak reachable is ``least`` bytes, where the step
    without checkpointing peaks at ``reference`` bytes (None: the caller knows it, the planner does not)."""

    budget_bytes: int
    least: int
    reference: int | None = None


__all__ = ["NoFit"]

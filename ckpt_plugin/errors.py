"""What a user typed wrong, as data: :class:`Problem` (key, problem, fix) and :class:`ConfigError`.

Every check in the package collects problems and raises them together, once,
so a user sees everything that is wrong in one run. Layers above add their own
problems to a lower layer's (``err.problems``); nobody parses a message again.
Imports nothing beyond the standard library: the engine, the schema and the
Lightning layer all use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input: the ``key`` (``"ckpt.every_n"``), what is wrong, how to fix it.

    ``value`` and ``least`` carry, as data, what a caller or a test may act on
    without reading the sentence: the value refused (a budget in bytes, say)
    and, for a budget no plan meets, the least activation peak reachable in bytes.
    """

    key: str
    problem: str
    fix: str = ""
    value: Any = field(default=None, compare=False)
    least: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.problem}; {self.fix}" if self.fix else self.problem


class ConfigError(ValueError):
    """Every problem found in one piece of input, raised together.

    A ``ValueError``, so ``except ValueError`` (and Hydra's instantiate, which
    re-raises it with the target named) keeps working; ``.problems`` holds the
    structured :class:`Problem` list.
    """

    def __init__(self, problems: Sequence[Problem], what: str = "the ckpt config") -> None:
        self.problems = list(problems)
        self.what = what
        if len(self.problems) == 1:
            message = str(self.problems[0])
        else:
            message = f"{len(self.problems)} problems in {what}:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.problems]


def raise_problems(problems: Sequence[Problem], what: str = "the ckpt config") -> None:
    """Raise one :class:`ConfigError` listing every problem (none: return)."""
    if problems:
        raise ConfigError(problems, what)


def closest_first(name: str, choices: Iterable[str]) -> list[str]:
    """``choices`` sorted so the ones most like ``name`` come first (then alphabetical)."""
    choices = sorted(set(choices))
    lowered = name.lower()
    score = {c: difflib.SequenceMatcher(None, name, c).ratio() for c in choices}
    # Substring hits ("block" -> "TransformerBlock") beat edit-distance ranking; ties stay alphabetical.
    return sorted(choices, key=lambda c: (lowered not in c.lower(), -score[c]))


__all__ = ["ConfigError", "Problem", "closest_first", "raise_problems"]

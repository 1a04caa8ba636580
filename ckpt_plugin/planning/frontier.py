"""The Pareto frontier every planner here keeps: the entries no other entry beats in every measure.

The per-layer planner (``planner.py``: bytes kept so far against cost, or against the
peak so far), the parts inside a layer (``inside.py``: kept, peak, peak in backward and
cost) and Rotor's chain (``rotor.py``: bytes needed against cost) all grow a list of
partial choices and drop the dominated ones; this is that step, written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def pareto(entries: Iterable[T], measures: Callable[[T], tuple]) -> list[T]:
    """The entries, in the order given, that no earlier kept entry is at most in every measure but the first.

    ``entries`` come sorted by their first measure (ascending; ties as the caller
    wants them broken: the first of equals is kept), so an earlier entry is never
    worse in it. With two measures that is a staircase: each kept entry's second
    measure is strictly below the last kept one's.
    """
    kept: list[T] = []
    rests: list[tuple] = []
    for entry in entries:
        rest = measures(entry)[1:]
        if len(rest) == 1:
            dominated = bool(rests) and rests[-1][0] <= rest[0]  # the staircase: the last kept is the lowest
        else:
            dominated = any(all(a <= b for a, b in zip(k, rest)) for k in rests)
        if not dominated:
            kept.append(entry)
            rests.append(rest)
    return kept


__all__ = ["pareto"]

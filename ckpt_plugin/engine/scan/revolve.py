"""Griewank's binomial checkpointing ("revolve") of a carry-only scan, as a plain list of actions.

Which carries of ``carry = fn(carry)`` to keep and when to recompute them, so
that backward reaches every step with at most ``snapshots`` carries kept and
the fewest calls of ``fn``; no tensors here, ``checkpoint_scan(...,
outputs="last")`` runs the actions::

    from ckpt_plugin.engine.scan.revolve import optimal_calls, schedule

    actions = schedule(10, 3)       # 10 steps, at most 3 carries kept (init included)
    actions[:5]                     # advance to 4, takeshot 4, advance to 7, takeshot 7, advance to 10
    actions[5]                      # Action('firsturn', 10): the forward ends, x_10 is the output
    optimal_calls(10, 3)            # (18, 10): calls of fn without and with grad, forward included

Carries are numbered by the steps done: ``x_0`` is ``init``, step ``i + 1``
maps ``x_i`` to ``x_{i+1}``, ``x_n`` is the output. The actions, in order:

* ``advance(i)``: run steps without grad from the current carry until it is ``x_i``;
* ``takeshot(i)``: keep the current carry ``x_i`` as a snapshot;
* ``restore(i)``: the current carry is the snapshot ``x_i`` again;
* ``free(i)``: drop the snapshot ``x_i``;
* ``firsturn(n)``: the forward is done, the current carry ``x_n`` is returned;
* ``youturn(i)``: run step ``i + 1`` from the current carry ``x_i`` with grad
  and backpropagate the gradient of ``x_{i+1}`` through it. Steps are
  reversed from the last to the first, each exactly once.

``x_0`` counts as a snapshot from the start to the end (it is ``init``).

The optimum (Griewank 1992; Griewank & Walther, ACM TOMS 26(1), 2000,
"Algorithm 799: revolve"): reversing ``l`` steps with ``s`` snapshots, the
first holding the chain's input, takes at least ``T(l, s) = t*l - C(s+t,
t-1)`` steps without grad, where ``t`` is the repetition number, the integer
with ``C(s+t-1, s) < l <= C(s+t, s)``; each step is then run once more with
grad. Griewank's count includes the forward sweep up to ``x_{l-1}``, where the
reverse sweep starts by taping step ``l``. Our forward goes one step further,
to the output ``x_n``, which the reversal never needs: it is Griewank's
reversal of ``l = n + 1`` steps whose last step is empty (the ``firsturn``);
the schedules of the one are those of the other, and so are their minima.
So a scan of ``n`` steps with ``k`` snapshots calls ``fn`` ``T(n + 1, k)``
times without grad, the forward's ``n`` included, and ``n`` times with grad:
``k = 1`` re-advances every step from ``init`` (``T = n(n+1)/2``), ``k >= n``
keeps ``x_0 .. x_{n-1}`` and re-advances nothing (``T = n``).
"""

from __future__ import annotations

from collections.abc import Iterator
from math import comb
from typing import Literal, NamedTuple

__all__ = ["Action", "actions", "min_advances", "optimal_calls", "repetitions", "schedule"]

Op = Literal["advance", "takeshot", "restore", "free", "firsturn", "youturn"]


class Action(NamedTuple):
    op: Op
    index: int  # the carry x_index the action is about


def repetitions(steps: int, snapshots: int) -> int:
    """Griewank's ``t``: the least ``t >= 0`` with ``C(snapshots + t, snapshots) >= steps``.

    ``t`` bounds how often any one step is re-advanced; ``T(l, s)`` grows by
    ``t`` per added step (it is convex and piecewise linear in ``l``).
    """
    assert steps >= 1 and snapshots >= 1, (steps, snapshots)
    if snapshots == 1:  # C(1 + t, 1) = t + 1
        return steps - 1
    t, beta = 0, 1  # beta = C(snapshots + t, snapshots)
    while beta < steps:
        t += 1
        beta = beta * (snapshots + t) // t
    return t


def min_advances(steps: int, snapshots: int) -> int:
    """Griewank's ``T(l, s) = t*l - C(s+t, t-1)``: the fewest steps without grad to reverse ``l`` steps."""
    t = repetitions(steps, snapshots)
    return t * steps - (comb(snapshots + t, t - 1) if t >= 1 else 0)


def optimal_calls(n_steps: int, snapshots: int) -> tuple[int, int]:
    """Calls of ``fn`` (without grad, with grad) for a scan of ``n_steps`` with ``snapshots`` carries.

    The forward's ``n_steps`` are counted in the first: its re-advances in
    backward are ``T(n_steps + 1, snapshots) - n_steps``.
    """
    return min_advances(n_steps + 1, snapshots), n_steps


def schedule(n_steps: int, snapshots: int) -> list[Action]:
    """The actions of an optimal reversal of ``n_steps`` with at most ``snapshots`` carries kept.

    Everything up to and including the one ``firsturn`` is the forward (only
    ``advance`` and ``takeshot``); the rest is the backward. Following it calls
    ``fn`` exactly :func:`optimal_calls` times.
    """
    if n_steps < 1 or snapshots < 1:
        raise ValueError(f"schedule: n_steps={n_steps} and snapshots={snapshots} must both be >= 1")
    return list(actions(n_steps, snapshots))


def actions(n_steps: int, snapshots: int) -> Iterator[Action]:
    """:func:`schedule` one action at a time (the scan keeps its place in it between forward and backward).

    Griewank's reversal of ``n_steps + 1`` steps, whose last, empty step is
    the ``firsturn``. Each part ``(a, b, s)`` reverses steps ``a+1 .. b`` from
    the current carry ``x_a``, held in one of its ``s`` snapshots: it advances
    to ``x_m`` and keeps it (:func:`_split` picks ``m``), reverses ``m .. b``
    with the other ``s - 1``, frees ``x_m``, restores ``x_a`` and reverses
    ``a .. m`` with all ``s``. Its cost ``m - a + T(b - m, s - 1) + T(m - a,
    s)`` is ``T(b - a, s)``; with one snapshot every step is re-advanced from
    ``x_a``. An explicit stack, not recursion: a long scan with few snapshots
    nests hundreds of parts deep.
    """
    last = n_steps  # the carry whose (empty) step is the firsturn
    todo: list[tuple[int, int, int]] = [(0, n_steps + 1, snapshots)]  # (a, b, s); s == 0: free x_b, restore x_a
    while todo:
        a, b, s = todo.pop()
        if s == 0:
            yield Action("free", b)
            yield Action("restore", a)
            continue
        if b - a >= 2 and s >= 2:
            m = a + _split(b - a, min(s, b - a))
            yield Action("advance", m)
            if m < b - 1:
                yield Action("takeshot", m)
                todo += [(a, m, s), (a, m, 0), (m, b, s - 1)]
            else:  # the right part is one step, from the current carry: a snapshot of it would serve nothing
                yield _turn(m, last)
                yield Action("restore", a)
                todo.append((a, m, s))
            continue
        for i in range(b - 1, a - 1, -1):  # one snapshot (or one step): every step from x_a
            if i < b - 1:
                yield Action("restore", a)
            if i > a:
                yield Action("advance", i)
            yield _turn(i, last)


def _turn(index: int, last: int) -> Action:
    return Action("firsturn" if index == last else "youturn", index)


def _split(steps: int, snapshots: int) -> int:
    """Where to put the next snapshot, counted from ``x_a``: a minimiser of ``j + T(l-j, s-1) + T(j, s)``.

    That cost is convex in ``j`` (``T`` is convex in its first argument and
    grows by the repetition number per step), so its least minimiser is the
    first ``j`` whose increment ``1 - t(l-j, s-1) + t(j+1, s)`` is not
    negative: a bisection, no table.
    """
    lo, hi = 1, steps - 1  # the answer lies in [lo, hi]; hi itself when no increment is >= 0
    while lo < hi:
        j = (lo + hi) // 2
        if 1 + repetitions(j + 1, snapshots) - repetitions(steps - j, snapshots - 1) >= 0:
            hi = j
        else:
            lo = j + 1
    return lo

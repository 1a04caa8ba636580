"""The optimal nesting of checkpointed regions over a chain, for a memory limit (``ckpt.segments: optimal``).

    costs = chain_costs(model, names, forward)     # profile.py: bytes and FLOPs per layer, on fake tensors
    best = solve(costs, limit)                      # the least recomputation whose predicted peak fits
    best.schedule                                   # engine/segments/sequential.py's nodes: ints and (nested) Regions

Rotor's dynamic programme (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova,
"Optimal checkpointing for heterogeneous chains: how to train deep neural
networks with limited memory", 2019), written here from its recurrence for
the memory our regions really hold, in activation bytes as MemTracker counts
them. A schedule is a list of nodes over the layers ``s..t``; the first
layer's input ``x[s]`` is held by whoever runs the list. Its forward runs each
node in turn, its backward walks them in reverse:

- a layer ``k`` run as it is keeps ``x[k]`` and ``kept[k]`` until its backward;
  while it runs, ``running[k]`` is alive beyond what the other nodes keep;
- a region ``[a, b)`` (non-reentrant ``torch.utils.checkpoint``) keeps only
  ``x[a]``; its layers run keeping nothing (``region_running``). When backward
  reaches it, its children are recomputed from ``x[a]`` as a list of their own,
  so a region inside it is checkpointed again, and torch stops that
  recomputation once the last tensor the region saved is back: its last layer
  runs only that far (``last_running``, ``last_flops``).

In backward, autograd only frees activations (gradients are not activations),
so new peaks come from forwards and recomputations only. For a list over
``s..t`` with ``m`` bytes to spare beyond what is held around it, the least
recomputation ``C(s, t, m)`` is either layer ``s`` run as it is, then
``C(s+1, t, m - kept[s] - x[s+1])``; or a region over ``s..j-1``, then
``C(j, t, m - x[j])`` and, once ``x[j]`` is freed, its own recomputation
``F(s, j-1) + C(s, j-1, m)``, where ``F`` is the FLOPs of recomputing
``s..j-1`` (each layer in full, the last one up to its last saved tensor).
The top list ends with what follows the chain (head, loss: ``after_running``),
so a region may close the chain there. ``C`` is a non-increasing step function
of ``m``; it is computed exactly, as the Pareto frontier of (bytes needed,
cost) per sub-chain: no memory discretisation, so the least peak reachable
is exact too (:func:`least_peak`). Equal costs go to fewer regions, then to
layers run as they are.

The model counts a layer's input as kept by it when run as it is (as
``profile.py`` does: a layer usually saves it) and nothing else twice.
``tests/test_rotor.py`` checks it against MemTracker on real chains.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields

from ckpt_plugin.engine.segments.sequential import Node, Region, regions
from ckpt_plugin.planning.frontier import pareto
from ckpt_plugin.planning.nofit import NoFit
from ckpt_plugin.units import format_bytes


@dataclass(frozen=True)
class ChainCosts:
    """What each layer ``0..L-1`` of a chain costs, in bytes (activations) and FLOPs.

    Every running figure counts the layer's input and what the model outside the
    chain keeps at that time (as ``profile.py`` measures it), not what other layers keep.
    """

    input_bytes: tuple[int, ...]  # x[k]: layer k's input (a region holds its first layer's)
    kept_bytes: tuple[int, ...]  # kept for backward when run as it is, beyond its input
    running_bytes: tuple[int, ...]  # alive while it runs as it is: input, keeps so far, temporaries, output
    region_running_bytes: tuple[int, ...]  # alive while it runs inside a region's forward (nothing kept)
    last_running_bytes: tuple[int, ...]  # alive while it is recomputed as a region's last layer
    flops: tuple[int, ...]  # one run of the layer
    last_flops: tuple[int, ...]  # its recomputation as a region's last layer (torch stops at the last save)
    after_running: int = 0  # alive while what follows the chain runs (head, loss), beyond the chain's keeps
    # Alive through backward beyond the chain's keeps (the loss, its gradient's seed): in every recomputation
    # but inside last_running_bytes, which is measured there.
    backward_bytes: int = 0

    def __post_init__(self) -> None:
        lengths = {f.name: len(getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), tuple)}
        assert len(set(lengths.values())) == 1, f"one value per layer in every field: {lengths}"

    @property
    def length(self) -> int:
        return len(self.input_bytes)


@dataclass(frozen=True)
class Solution:
    """A schedule over the chain, its predicted activation peak and what it recomputes."""

    schedule: tuple[Node, ...]
    recompute_flops: int
    predicted_peak: int
    limit: int
    least_peak: int
    names: tuple[str, ...] = ()  # the layers' names, for the summary

    def __str__(self) -> str:
        count = len(regions(self.schedule))
        return "\n".join([
            f"schedule ({count} checkpointed region{'s' * (count != 1)}): {describe(self.schedule, self.names)}",
            (f"predicted activation peak {format_bytes(self.predicted_peak)} ({self.predicted_peak} B) <= limit "
             f"{format_bytes(self.limit)} ({self.limit} B); the least any schedule reaches is "
             f"{format_bytes(self.least_peak)} ({self.least_peak} B)"),
            f"recomputed FLOPs {self.recompute_flops:,}",
        ])


class Unreachable(ValueError):
    """No schedule keeps the predicted peak within the limit; ``least`` is the least peak reachable."""

    def __init__(self, limit: int, least: int) -> None:
        self.limit, self.least = limit, least
        super().__init__(f"no schedule of the chain stays within {limit} bytes: the least peak reachable is "
                         f"{least} bytes")


def describe(nodes: Sequence[Node], names: Sequence[str] = ()) -> str:
    """``[0, 1, (2-5: [(2-3), 4, 5]), 6]``: a region as ``(first-last: its children)``, layers by index.

    With ``names`` (qualified names of the layers) the layers read ``blocks.0`` instead of ``0``.
    """
    def name(k: int) -> str:
        return names[k] if names else str(k)

    def one(node: Node) -> str:
        if isinstance(node, int):
            return name(node)
        inner = node.children
        if all(isinstance(c, int) for c in inner):
            return f"({name(node.start)}-{name(node.stop - 1)})" if len(inner) > 1 else f"({name(node.start)})"
        return f"({name(node.start)}-{name(node.stop - 1)}: {describe(inner, names)})"

    return "[" + ", ".join(one(n) for n in nodes) + "]"


# ---------------------------------------------------------------------- the model, walked

def simulate(costs: ChainCosts, nodes: Sequence[Node]) -> tuple[int, int]:
    """(predicted peak, recomputed FLOPs) of ``nodes`` over the whole chain: the model, step by step.

    Independent of the dynamic programme (it walks any schedule, trailing regions
    included), so tests check the solver's claims against it.
    """
    c, x = costs, (*costs.input_bytes, 0)  # the chain's output is counted in after_running
    peak = flops = 0

    def walk(nodes: Sequence[Node], around: int, recomputing: bool) -> None:
        nonlocal peak, flops
        around += c.backward_bytes if recomputing else 0
        held = 0  # beyond ``around``, which holds the first node's input
        adds = []
        for i, node in enumerate(nodes):
            last = i == len(nodes) - 1
            if isinstance(node, int):
                tail = recomputing and last  # torch stops after this layer's last saved tensor
                running = c.last_running_bytes[node] - c.backward_bytes if tail else c.running_bytes[node]
                peak = max(peak, around + held + running - x[node])
                flops += (c.last_flops[node] if tail else c.flops[node]) if recomputing else 0
                add = c.kept_bytes[node] + (0 if last else x[node + 1])
            else:
                if not (recomputing and last):  # a trailing region: torch stops once its input is saved
                    for k in range(node.start, node.stop):
                        first = x[k] if k == node.start else 0
                        peak = max(peak, around + held + c.region_running_bytes[k] - first)
                        flops += c.flops[k] if recomputing else 0
                add = 0 if last else x[node.stop]
            adds.append(add)
            held += add
        if not recomputing:
            peak = max(peak, around + held + c.after_running)
        around -= c.backward_bytes if recomputing else 0
        for node, add in zip(reversed(nodes), reversed(adds)):
            held -= add
            if isinstance(node, Region):
                walk(node.children, around + held, True)

    walk(nodes, x[0], False)
    return peak, flops


# ---------------------------------------------------------------------- the dynamic programme

Cost = tuple[int, int]  # (recomputed FLOPs, regions): fewer regions break ties
_ZERO: Cost = (0, 0)


@dataclass(frozen=True)
class _Frontier:
    """A non-increasing step function: ``cost(m)`` is the cost of the last ``needs[i] <= m``."""

    needs: tuple[int, ...]
    costs: tuple[Cost, ...]

    def at(self, m: int) -> Cost | None:
        i = bisect.bisect_right(self.needs, m)
        return self.costs[i - 1] if i else None


def _pareto(points: list[tuple[int, Cost]]) -> _Frontier:
    kept = pareto(sorted(points), lambda point: point)
    return _Frontier(tuple(need for need, _ in kept), tuple(cost for _, cost in kept))


class _Solver:
    """``frontier(s, t, top)``: the least cost of a list over ``s..t`` against the bytes it needs.

    ``top``: the list the training step runs (``t`` is then the head: the layer ``L``),
    else a region's recomputation. Memory is counted beyond what is held around the
    list, its first input included.
    """

    def __init__(self, costs: ChainCosts) -> None:
        self.c = costs
        L = costs.length
        self.x = (*costs.input_bytes, 0)
        prefix = [0]
        for f in costs.flops:
            prefix.append(prefix[-1] + f)
        self.prefix = prefix
        self.frontier = functools.cache(self._frontier)
        self.L = L

    def _own_run(self, k: int, top: bool, t: int) -> int:
        """Bytes layer ``k`` needs run as it is, beyond its input (its input is held around it)."""
        c = self.c
        if top and k == self.L:
            return c.after_running
        if not top and k == t:
            return c.last_running_bytes[k] - self.x[k]  # measured in backward: backward_bytes included
        return c.running_bytes[k] - self.x[k] + (0 if top else c.backward_bytes)

    def _region_need(self, s: int, j: int, top: bool) -> int:
        """Bytes the forward of a region over ``s..j-1`` needs beyond its input."""
        c = self.c
        inside = max([c.region_running_bytes[s] - self.x[s], *(c.region_running_bytes[k] for k in range(s + 1, j))])
        return inside + (0 if top else c.backward_bytes)

    def recompute(self, s: int, e: int) -> int:
        """FLOPs of recomputing ``s..e``: each layer in full but the last, which stops at its last save."""
        return self.prefix[e] - self.prefix[s] + self.c.last_flops[e]

    def options(self, s: int, t: int, top: bool) -> list[tuple[int, Cost, _Frontier, int, _Frontier | None, int]]:
        """Each way to start the list: (need of its first step, cost added, rest, shift, region frontier, j)."""
        out = []
        x, c = self.x, self.c
        if s == t:
            return out
        rest = self.frontier(s + 1, t, top)
        out.append((self._own_run(s, top, t), _ZERO, rest, c.kept_bytes[s] + x[s + 1], None, s + 1))
        for j in range(s + 1, t + 1):  # the rest, j..t, is never empty
            inner = self.frontier(s, j - 1, False)  # the region's own recomputation
            out.append((self._region_need(s, j, top), (self.recompute(s, j - 1), 1), self.frontier(j, t, top), x[j],
                        inner, j))
        return out

    def _frontier(self, s: int, t: int, top: bool) -> _Frontier:
        if s == t:
            return _Frontier((self._own_run(s, top, t),), (_ZERO,))
        points: list[tuple[int, Cost]] = []
        for need, added, rest, shift, inner, _j in self.options(s, t, top):
            marks = {max(need, n + shift) for n in rest.needs}
            if inner is not None:
                marks |= {max(need, n) for n in inner.needs}
            for m in marks:
                cost = self._value(m, added, rest, shift, inner)
                if cost is not None:
                    points.append((m, cost))
        return _pareto(points)

    @staticmethod
    def _value(m: int, added: Cost, rest: _Frontier, shift: int, inner: _Frontier | None) -> Cost | None:
        after = rest.at(m - shift)
        if after is None:
            return None
        if inner is None:
            return added[0] + after[0], added[1] + after[1]
        back = inner.at(m)
        if back is None:
            return None
        return added[0] + after[0] + back[0], added[1] + after[1] + back[1]

    def build(self, s: int, t: int, top: bool, m: int) -> list[Node]:
        """The nodes of the list over ``s..t`` with the least cost within ``m`` spare bytes."""
        if s == t:
            return [] if top else [s]  # the top list's last step is the head, no layer
        best = None
        for need, added, rest, shift, inner, j in self.options(s, t, top):
            if m < need:
                continue
            cost = self._value(m, added, rest, shift, inner)
            if cost is not None and (best is None or cost < best[0]):  # strict: layers first, then short regions
                best = (cost, j, inner is not None, shift)
        assert best is not None, "build() is called only where the frontier says the list fits"
        _cost, j, region, shift = best
        if not region:
            return [s, *self.build(s + 1, t, top, m - shift)]
        return [Region(s, j, tuple(self.build(s, j - 1, False, m))), *self.build(j, t, top, m - shift)]


def _top(costs: ChainCosts) -> tuple[_Solver, _Frontier]:
    if costs.length < 1:
        raise ValueError("a chain needs at least one layer")
    solver = _Solver(costs)
    return solver, solver.frontier(0, costs.length, True)


def least_peak(costs: ChainCosts) -> int:
    """The least predicted peak any nesting of checkpointed regions reaches on the chain."""
    _solver, top = _top(costs)
    return costs.input_bytes[0] + top.needs[0]


def tradeoffs(costs: ChainCosts) -> list[tuple[int, int]]:
    """Every (predicted peak, recomputed FLOPs) where more memory starts to save FLOPs: the whole frontier."""
    _solver, top = _top(costs)
    points: list[tuple[int, int]] = []
    for need, (flops, _regions) in zip(top.needs, top.costs):
        if not points or flops < points[-1][1]:
            points.append((costs.input_bytes[0] + need, flops))
    return points


def solve(costs: ChainCosts, limit: int, names: Sequence[str] = ()) -> Solution:
    """:func:`fit`, raising :class:`Unreachable` (a ``ValueError``) with the least peak where no schedule fits."""
    solution = fit(costs, limit, names)
    if isinstance(solution, NoFit):
        raise Unreachable(limit, solution.least)
    return solution


def fit(costs: ChainCosts, limit: int, names: Sequence[str] = ()) -> Solution | NoFit:
    """The schedule with the least recomputation (then the fewest regions) whose predicted peak is within ``limit``;
    a :class:`NoFit` with the least peak any schedule reaches where none is."""
    solver, top = _top(costs)
    least = costs.input_bytes[0] + top.needs[0]
    spare = limit - costs.input_bytes[0]
    cost = top.at(spare)
    if cost is None:
        return NoFit(limit, least)
    nodes = tuple(solver.build(0, costs.length, True, spare))
    peak, flops = simulate(costs, nodes)
    assert peak <= limit and flops == cost[0] and len(regions(nodes)) == cost[1], (nodes, peak, flops, cost)
    return Solution(nodes, flops, peak, limit, least, tuple(names))


__all__ = ["ChainCosts", "Solution", "Unreachable", "describe", "fit", "least_peak", "simulate", "solve", "tradeoffs"]

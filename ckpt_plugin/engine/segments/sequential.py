"""Checkpointing a chain of functions in segments: fixed, square root, or recursive.

    y = checkpoint_sequential([torch.sin] * 64, "recursive", x)
    y = checkpoint_sequential(model.blocks, 4, x)          # 4 checkpointed segments

A *schedule* is a list of nodes over the chain's indices ``0..L-1``: an ``int``
is a function run as it is, a :class:`Region` is a checkpointed run of
consecutive functions whose own children may be regions again.

- ``segments=S``: S regions of (almost) equal length; memory ~ S inputs plus
  one segment's activations, one extra forward (Chen et al. 2016 with S = √L).
- ``"sqrt"``: S = ⌈√L⌉.
- ``"recursive"``: the chain is halved, each half a region, recursively down to
  single functions (the seed's ``recursive_checkpoint``): O(log L) inputs kept
  at any time for O(L log L) recompute; JAX users ask for it (jax#2139).
- ``"optimal"``: the nesting with the least recomputation for a memory budget,
  planned from the layers' measured costs (``planning/rotor.py``; ``ckpt.budget``);
  the planner hands its schedule over as the nodes themselves, which
  ``segments`` also takes: ``checkpoint_sequential(fns, solve(costs, limit).schedule, x)``.

Unlike ``torch.utils.checkpoint.checkpoint_sequential`` every segment is
checkpointed, the last one included, so ``segments=1`` is the whole chain as
one region and never a silent no-op.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_plugin._compat import non_reentrant_checkpoint
from ckpt_plugin.config.values import segment_problems
from ckpt_plugin.errors import ConfigError, Problem, raise_problems

@dataclass(frozen=True)
class Region:
    """A checkpointed run of functions ``start..stop-1``; ``children`` partition it."""

    start: int
    stop: int
    children: tuple[int | Region, ...]


Node = int | Region


def schedule(length: int, segments: int | str | Sequence[Node], key: str = "ckpt.segments") -> list[Node]:
    """The nodes of a chain of ``length`` functions under ``segments`` (or ``segments`` itself, a schedule)."""
    if isinstance(segments, (list, tuple)):
        return _checked(list(segments), length, key)
    raise_problems(segment_problems(segments, key), key)
    if length < 1:
        raise ConfigError([Problem(key, f"{key}: there is no function to checkpoint (the chain is empty)")], key)
    if segments == "optimal":
        raise ConfigError([Problem(
            key, f"{key}='optimal' is planned from the layers' costs and a memory budget, not from their number",
            "use apply_checkpointing(model, layers=..., segments='optimal', budget=...), or pass the planned "
            "schedule (planning.rotor.solve(costs, limit).schedule) as segments",
        )], key)
    if segments == "recursive":  # a top-level half of one layer is a region too (else L=2 checkpoints nothing)
        halves = _halve(0, length).children if length > 1 else (0,)
        return [c if isinstance(c, Region) else Region(c, c + 1, (c,)) for c in halves]
    count = math.ceil(math.sqrt(length)) if segments == "sqrt" else segments
    if count > length:
        raise ConfigError([Problem(
            key,
            f"{key}={segments} asks for more segments than the {length} layers of the chain",
            f"use a value from 1 to {length}, 'sqrt' or 'recursive'",
        )], key)
    bounds = [round(i * length / count) for i in range(count + 1)]
    return [Region(a, b, tuple(range(a, b))) for a, b in zip(bounds, bounds[1:])]


def _checked(nodes: list[Node], length: int, key: str) -> list[Node]:
    """``nodes`` if they cover ``0..length-1`` in order, each region by its children; else a ConfigError."""
    def covers(nodes: Sequence[Node], start: int, stop: int) -> bool:
        at = start
        for node in nodes:
            if isinstance(node, Region):
                if node.start != at or node.stop <= at or not covers(node.children, node.start, node.stop):
                    return False
                at = node.stop
            elif isinstance(node, int) and not isinstance(node, bool) and node == at:
                at += 1
            else:
                return False
        return at == stop and at > start

    if not covers(nodes, 0, length):
        raise ConfigError([Problem(key, f"{key}: the schedule {nodes!r} does not cover the {length} layers "
                                   "0..L-1 in order (each region by its children)")], key)
    return nodes


def _halve(start: int, stop: int) -> Region:
    mid = (start + stop) // 2
    halves = [(start, mid), (mid, stop)]
    return Region(start, stop, tuple(_halve(a, b) if b - a > 1 else a for a, b in halves))


def regions(nodes: Sequence[Node]) -> list[Region]:
    """Every region of a schedule, outer before inner."""
    found: list[Region] = []
    for node in nodes:
        if isinstance(node, Region):
            found.append(node)
            found.extend(regions(node.children))
    return found


def checkpoint_sequential(
    functions: Sequence[Callable[..., Any]],
    segments: int | str | Sequence[Node],
    *inputs: Any,
    preserve_rng_state: bool = True,
) -> Any:
    """Run ``functions`` as a chain on ``inputs`` with checkpointed segments.

    The first function gets ``*inputs``, each next one the previous output.
    ``functions`` may be modules (an ``nn.Sequential``) or plain callables.
    """
    functions = list(functions)
    if not all(callable(f) for f in functions):
        bad = [type(f).__name__ for f in functions if not callable(f)]
        raise ConfigError([Problem(
            "functions", f"checkpoint_sequential: every function must be callable, got {', '.join(bad)}"
        )], "the functions of checkpoint_sequential")
    nodes = schedule(len(functions), segments, key="segments")

    def run(nodes: Sequence[Node], *args: Any) -> Any:
        for node in nodes:
            if isinstance(node, Region):
                out = non_reentrant_checkpoint(run, node.children, *args, preserve_rng_state=preserve_rng_state)
            else:
                out = functions[node](*args)
            args = (out,)
        return out

    return run(nodes, *inputs)

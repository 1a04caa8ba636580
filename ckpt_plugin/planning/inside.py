"""Options inside a layer: its parts (child modules, and theirs) checkpointed instead of, or inside, the layer.

A layer's three options (``planner.py``) cannot go below what ``full`` on it
reaches: its recomputation holds everything the layer keeps, at once. Its
parts can split that. ``profile.py`` measures the parts of the layers as it
measures the layers (fake tensors, every part of one level under one option
at a time, the levels above recorded as windows, unwrapped) and each layer's
own ops around its parts (its *glue*: a residual add, a functional ReLU);
here a dynamic programme over the parts, in the order they run, turns those
numbers into more options for the layer, which the planner weighs with the rest:

- ``inside#k``: the layer runs unwrapped, each part under its own option;
- ``full+inside#k``: the layer is ``full`` and, inside its recomputation,
  each part under its own option (nested checkpoints: the layer keeps only its
  inputs, and its recomputation holds what the parts keep, not what it keeps).

    python recipes/train.py ckpt=auto ckpt.layers=TransformerBlock ckpt.budget=0.1   # below full's 0.12

A part's options are the same three and, where its parts were measured, its
own inside options, so the programme recurses (``profile.INSIDE_DEPTH``
levels). The peak model is the planner's, one level down: while part ``j``
runs (or recomputes) the parts before it keep what they keep, plus its
running bytes; while the glue after part ``j`` runs, parts ``1..j`` keep
theirs, plus the glue's running bytes, which hold what the glue keeps so far::

    running(inside) = max(max_j(kept[1..j-1] + running[j]), max_j(kept[1..j] + glue_running[j]))
    kept(inside) = glue_kept + kept[1] + ... + kept[k]

A part's running bytes count what is alive beyond the keeps of the windows
that ended before it began (``recorder.Recorder.analyse``), so what its
layer's glue keeps, or a later part keeps already, is in them. A tensor that
the glue and a part both keep is the layer's (the glue keeps it whatever the
part's option), and a part left unwrapped keeps of its inputs only what its
ops save (a ReLU saves its output, not its input).

For ``full+inside`` the layer keeps what ``full`` keeps and its running bytes
are the larger of its forward under checkpoint (nothing kept inside) and the
same chain, which its recomputation runs in backward: there every unit also
holds what outlives the forward until backward (the loss, its targets:
``Chain.held``), so each part is taken as it is in backward
(``Cost.backward_running``: its forward plus ``held``, or its own
recomputation). Recompute FLOPs and seconds add up: the parts' own, plus the
layer's full recomputation for the nested option.

The programme keeps, part after part, every choice no other beats in (bytes
kept so far, peak so far, peak so far in backward, cost): exact, and small,
since a layer has a few parts with a few options each. Exact to the byte
against MemTracker on the example GPT and ResNet (``tests/test_inside.py``);
where a model's glue shares tensors with its parts in ways one number per
part cannot describe, ``Profile.plan`` measures the plan it chose.

Parts help where a layer's recomputation holds much its parts need not hold
at once: a transformer block (attention, MLP) below ``full``'s peak. Child
modules alone cannot split a layer whose every kept tensor is the input of the
next op (the example ResNet's ``Bottleneck``: each convolution and BatchNorm
keeps its input, and ReLU its output, whatever is checkpointed around each);
there the parts are its op groups (``engine/op_groups.py``: runs of ops, each
kept only as its input when checkpointed), measured and planned here alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_plugin.planning.frontier import pareto
from ckpt_plugin.planning.options import FULL, INSIDE, KEEP, OPTIONS, Option
from ckpt_plugin.planning.planner import Cost, Part


@dataclass(frozen=True)
class Chain:
    """A layer's parts and its own ops around them, as measured (``profile.py``).

    ``parts``: the modules its forward calls directly, once each, in the order they
    run. ``glue_kept``: what its own ops keep for backward (not its parts).
    ``glue_running``: the running bytes of its own ops before the first part,
    between two parts, after the last (``len(parts) + 1``), its keeps so far
    included. ``forward_running``: its running bytes in forward under ``full``.
    ``held``: what is alive through backward beyond every layer (the loss).
    """

    parts: tuple[str, ...]
    glue_kept: int
    glue_running: tuple[int, ...]
    forward_running: int
    held: int = 0


# (kept so far, peak so far, peak so far in backward, (seconds, FLOPs, parts wrapped), parts listed)
_Entry = tuple[int, int, int, tuple[float, int, int], tuple[Part, ...]]


def with_inside(name: str, leaves: Mapping[str, Mapping[Option, Cost]],
                chains: Mapping[str, Chain]) -> dict[Option, Cost]:
    """The options of ``name``: its measured ones (``leaves[name]``) and, if it has a chain, those inside it."""
    own = dict(leaves[name])
    chain = chains.get(name)
    if chain is None or not chain.parts:
        return own
    parts = [with_inside(part, leaves, chains) for part in chain.parts]
    derived: dict[Option, Cost] = {}
    full = own.get(FULL)
    for i, (kept, peak, late, (seconds, flops, _), listed) in enumerate(_frontier(chain, parts), 1):
        if not listed:  # every part kept: the layer as it is
            continue
        derived[INSIDE.with_parts(i)] = Cost(chain.glue_kept + kept, flops, peak, seconds, listed,
                                             backward_running=late)
        if full is not None:
            derived[FULL.with_parts(i)] = Cost(
                full.kept_bytes, full.recompute_flops + flops, max(chain.forward_running, late),
                full.seconds + seconds, listed, backward_running=max(chain.forward_running + chain.held, late))
    return own | _undominated(derived, own)


def _cost(option: Option, cost: Cost) -> tuple[float, int, int]:
    """What an option of a part adds: seconds, FLOPs, and 1 for every part it wraps (ties go to fewer)."""
    return cost.seconds, cost.recompute_flops, (option != KEEP) + len(cost.parts)


def _frontier(chain: Chain, parts: list[dict[Option, Cost]]) -> list[_Entry]:
    """Every choice of options for the parts that no other beats in kept bytes, peaks and cost."""
    glue, held = chain.glue_running, chain.held
    front: list[_Entry] = [(0, glue[0], glue[0] + held, (0.0, 0, 0), ())]
    for j, (name, options) in enumerate(zip(chain.parts, parts), 1):
        grown = []
        for kept, peak, late, (seconds, flops, wraps), listed in front:
            for option, c in options.items():
                t, f, w = _cost(option, c)
                part = (Part(name, option.kind, c.kept_bytes, c.recompute_flops), *c.parts) if w else ()
                now = kept + c.kept_bytes
                in_backward = c.backward_running if c.backward_running is not None else c.running_bytes + held
                grown.append((now, max(peak, kept + c.running_bytes, now + glue[j]),
                              max(late, kept + in_backward, now + glue[j] + held),
                              (seconds + t, flops + f, wraps + w), listed + part))
        front = _pareto(grown)
    return front


def _pareto(entries: list[_Entry]) -> list[_Entry]:
    """The entries no other is at most in all of kept, peak, peak in backward and cost (the first of equals)."""
    return pareto(sorted(entries, key=lambda e: e[:4]), lambda e: e[:4])


def _undominated(derived: dict[Option, Cost], own: Mapping[Option, Cost]) -> dict[Option, Cost]:
    """The derived options no option of the layer beats (or equals) in kept bytes, running bytes and cost."""

    def key(option: Option, c: Cost) -> tuple:
        return c.kept_bytes, c.running_bytes, c.seconds, c.recompute_flops, _rank(option)

    def beats(a: tuple, b: tuple) -> bool:
        return a[0] <= b[0] and a[1] <= b[1] and a[2:] <= b[2:]

    everything = [key(o, c) for o, c in own.items()]
    out: dict[Option, Cost] = {}
    for option, c in sorted(derived.items(), key=lambda item: key(*item)):
        k = key(option, c)
        if not any(beats(other, k) for other in everything):
            out[option] = c
            everything.append(k)
    return out


def _rank(option: Option) -> int:
    # The layer's own options in OPTIONS' order, then those inside it: unwrapped (inside#k) before nested
    # (full+inside#k), and among either a k of fewer digits first, as the length of their names has always
    # ranked them (kept, so that plans stay as they are: of options equal in the rest, the earlier stands).
    return OPTIONS.index(option) if option in OPTIONS else len(OPTIONS) + len(str(option))


__all__ = ["Chain", "with_inside"]

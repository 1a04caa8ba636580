"""Candidates inside the layers: their parts, measured level by level as the layers are (``inside.py`` plans with them).

A layer's parts are the modules its forward calls directly (:func:`parts_of`);
for a layer whose forward has chains of ops (``engine/op_groups.py``), its op
groups stand in for the ops they run, while it is regrouped
(:func:`regrouped_while`) and only if the groups ran in a step
(:func:`ran_as_groups`). :func:`measure_parts` steps each level of parts under
each option, the levels above recorded around them (``steps.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from ckpt_plugin.engine.blocks import has_forward
from ckpt_plugin.engine.op_groups import is_regrouped, regroup, top_groups, ungroup
from ckpt_plugin.engine.op_groups import parts as op_group_parts
from ckpt_plugin.planning.inside import Chain
from ckpt_plugin.planning.options import FULL, KEEP, PART_OPTIONS, Option, offered
from ckpt_plugin.planning.planner import Cost
from ckpt_plugin.planning.recorder import Recorder
from ckpt_plugin.planning.steps import recorded_step, step_where_it_runs

log = logging.getLogger("ckpt_plugin")


def parts_of(model: nn.Module, name: str) -> list[str]:
    """The modules the forward of ``name`` may call directly: its children, a ModuleList's items in its place;
    for a module regrouped (``op_groups.py``), its op groups and the children it calls outside them."""
    grouped = op_group_parts(model.get_submodule(name))
    if grouped is not None:
        return [f"{name}.{part}" if name else part for part in grouped]
    found = []
    for child, module in model.get_submodule(name).named_children():
        qualified = f"{name}.{child}" if name else child
        found += [qualified] if has_forward(module) else parts_of(model, qualified)
    return found


def measure_parts(model: nn.Module, names: list[str], forward: Callable[[], Any], mode: Any, depth: int,
                  forward_running: dict[str, int]) -> tuple[dict[str, dict[Option, Cost]], dict[str, Chain]]:
    """Each level of parts below ``names``, as ``profile.py`` measures the layers: their options and chains.

    Three steps per level, every part of the level under one option, the levels
    above recorded as windows, unwrapped. A module gets a chain (``inside.Chain``)
    when it ran once and each of its parts ran once in it. A part's option that
    keeps no less and runs no lighter than ``keep`` is dropped (never worth a
    timing). A level whose parts cannot be checkpointed (the step fails) ends the
    descent: the layers keep the options measured above it.
    """
    parts: dict[str, dict[Option, Cost]] = {}
    chains: dict[str, Chain] = {}
    levels = [list(names)]
    for _ in range(depth):
        level = [part for name in levels[-1] for part in parts_of(model, name)]
        if not level:
            break
        around = [name for above in levels for name in above]
        try:
            keep = recorded_step(model, level, forward, KEEP, fake=mode, around=around)
            twice = {part for part in level if keep.calls[part] > 1}
            if twice:  # a part called twice (a shared drop-path) is no candidate: its calls are its layer's own ops
                level = [part for part in level if part not in twice]
                keep = recorded_step(model, level, forward, KEEP, fake=mode, around=around) if level else None
            steps = _parts_steps(model, level, forward, mode, around, keep) if level else {}
        except Exception as err:  # noqa: BLE001 -- parts are an extra: the layers' own options stand
            log.debug("ckpt=auto: no candidates inside %s: checkpointing its parts fails (%s: %s)",
                      ", ".join(levels[-1][:3]), type(err).__name__, err)
            break
        if not level:
            break
        recorders, flops = {o: r for o, (r, _, _) in steps.items()}, {o: f for o, (_, f, _) in steps.items()}
        lacking = {o: parts_out for o, (_, _, parts_out) in steps.items()}  # option -> parts that cannot run it
        kept = {o: r.analyse()[0] for o, r in recorders.items()}
        keep = recorders[KEEP]
        held = max(r.late_alive for r in recorders.values())  # the loss: alive in backward, where a recomputation runs
        for name in levels[-1]:
            inner = keep.parts.get(name) or []
            once = all(r.calls[n] == 1 and r.parts.get(name) == inner for r in recorders.values() for n in [name, *inner])
            if not inner or not once or name not in forward_running:
                continue
            glue = tuple(max(r.unit_running.get((name, j), 0) for r in recorders.values()) for j in range(len(inner) + 1))
            chains[name] = Chain(tuple(inner), max(k.get(name, 0) for k in kept.values()), glue, forward_running[name],
                                 held)
            for part in inner:
                options = {o: Cost(kept[o].get(part, 0), flops[o].get(part, 0), r.unit_running.get((part, 0), 0),
                                   backward_running=max(r.unit_forward.get((part, 0), 0) + held,
                                                        r.unit_recompute.get((part, 0), 0)))
                           for o, r in recorders.items()}
                plain = options[KEEP]
                parts[part] = {o: c for o, c in options.items() if o == KEEP or part not in lacking[o] and (
                               c.kept_bytes < plain.kept_bytes or c.running_bytes < plain.running_bytes)}
                forward_running[part] = recorders[FULL].unit_forward.get((part, 0), 0)
        levels.append([part for part in level if part in parts])
    return parts, chains


@contextlib.contextmanager
def regrouped_while(model: nn.Module, names: Iterable[str]) -> Iterator[tuple[str, ...]]:
    """The layers ``names`` regrouped (``op_groups.py``) for as long as it lasts; yields those that have groups."""
    modules = dict(model.named_modules())
    added = [n for n in names if not is_regrouped(modules[n]) and regroup(modules[n])]
    try:
        yield tuple(n for n in names if is_regrouped(modules[n]))
    finally:
        for name in added:
            ungroup(modules[name])


def ran_as_groups(model: nn.Module, names: list[str], forward: Callable[[], Any], mode: Any,
                  grouped: tuple[str, ...]) -> tuple[str, ...]:
    """Those of the ``grouped`` layers whose op groups ran in a step; the others are ungrouped again.

    A traced forward runs only for calls like the traced one (``op_groups.TracedForward``):
    a layer called with keywords (a Hugging Face layer's ``attention_mask=``) runs its own
    forward, so its parts are its child modules, as without groups."""
    if not grouped:
        return grouped
    modules = dict(model.named_modules())
    tops = {layer: [f"{layer}.{g}" for g in top_groups(modules[layer])] for layer in grouped}
    recorder = recorded_step(model, [g for gs in tops.values() for g in gs], forward, KEEP, fake=mode, around=names)
    unused = [layer for layer, gs in tops.items() if not all(recorder.calls[g] for g in gs)]
    for layer in unused:
        ungroup(modules[layer])
    return tuple(layer for layer in grouped if layer not in unused)


def _parts_steps(model: nn.Module, level: list[str], forward: Callable[[], Any], mode: Any,
                 around: list[str], keep: Recorder) -> dict[Option, tuple[Recorder, dict[str, int], set[str]]]:
    """Option -> (the memory step's recorder, recomputed FLOPs by part, the parts that cannot run under it) with
    every part of ``level`` under it where it runs; ``keep``'s memory step is given (it ran first, to find the
    parts called twice)."""
    stepped = {KEEP: (keep, set())} | {o: step_where_it_runs(model, level, forward, o, mode, around)
                                       for o in offered(PART_OPTIONS) if o != KEEP}
    return {o: (r, dict(r.flops) if o != KEEP else {}, lacking) for o, (r, lacking) in stepped.items()}


__all__ = ["measure_parts", "parts_of", "ran_as_groups", "regrouped_while"]

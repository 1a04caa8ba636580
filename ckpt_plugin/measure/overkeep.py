"""A fixed mode that keeps more on a layer than no checkpointing keeps there (issue #33, item 4).

    rows = over_kept(model, names, forward)   # after install: [OverKeep(...)], [] when none
    warnings.warn(overkeep_warning(rows, "ckpt=selective"))

Checkpointing a layer keeps its inputs for the recomputation and, under a
selective policy, the outputs the policy saves. Where the layer's own forward
would have kept less (PyG's ``SAGEConv`` adds two linear outputs that no
backward needs; ``matmuls`` saves both), the mode costs memory *and*
recomputation on that layer: GraphSAGE under ``ckpt=selective`` peaked at
1.19x the step without checkpointing, silently. ``ckpt=auto`` never makes
that choice (a keep that keeps less and recomputes nothing dominates it on the
planner's frontier, ``planning/planner.py``); a fixed mode is told here.

Counted on fake tensors, one forward without and one with (no backward, no
real step), as the report counts (``memory.SavedCounter``) with one difference:
a storage counts for *each* layer that keeps it, not only the first one seen.
The report's first-owner rule splits a tensor two layers keep (GraphSAGE's
``edge_index``) by which ran first, and that first one differs without and
with checkpointing: compared row by row, it would both hide and invent excess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import checkpoint_placeholder, storage_key, tree_leaves, user_module
from ckpt_plugin.engine.forwards import instance_forward
from ckpt_plugin.engine.wrap import CheckpointedForward, checkpointing_disabled, compiling_paused
from ckpt_plugin.measure.memory import is_parameter
from ckpt_plugin.measure.report import on_fake_model
from ckpt_plugin.measure.values import with_values_replayed
from ckpt_plugin.units import format_bytes


@dataclass(frozen=True)
class OverKeep:
    """One layer that keeps more for backward as installed (``kept_with``) than without checkpointing."""

    name: str
    cls: str
    kept_with: int
    kept_without: int

    def __str__(self) -> str:
        return (f"{self.name} ({self.cls}) keeps {self.kept_with:,} bytes ({format_bytes(self.kept_with)}) where "
                f"no checkpointing keeps {self.kept_without:,} bytes ({format_bytes(self.kept_without)})")


def kept_by_layer(model: nn.Module, names: list[str], forward: Callable[[], Any]) -> dict[str, int]:
    """Bytes autograd keeps for backward while each layer of ``names`` runs, on fake tensors (one forward).

    As ``memory.saved_bytes``, parameters and buffers excluded, a checkpointed layer charged the inputs it
    holds for its recomputation; but each storage counts once per layer, for every layer that keeps it.
    Raises ``NotFakeable`` where the forward cannot run on fake tensors.
    """
    modules = dict(model.named_modules())
    fixed = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    kept = dict.fromkeys(names, 0)
    seen: set[tuple[str, tuple[str, int]]] = set()
    owners: list[str | None] = [None]

    def add(t: torch.Tensor) -> None:
        owner = owners[-1]
        if owner is None or is_parameter(t) or checkpoint_placeholder(t) or storage_key(t) in fixed:
            return
        if (owner, storage_key(t)) not in seen:
            seen.add((owner, storage_key(t)))
            kept[owner] += t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        add(t)
        return t.detach()  # as SavedCounter.pack: no reference cycle through the graph (pytorch#115255)

    def pre(module: nn.Module, args: Any, kwargs: Any, name: str) -> None:
        owners.append(name)
        wrapper = instance_forward(module)
        if isinstance(wrapper, CheckpointedForward) and wrapper.treatment.checkpointing:  # held to recompute
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    add(t)

    def post(*_: Any) -> None:  # returns None: a forward hook's value would replace the output
        owners.pop()

    handles = []
    for name in names:
        handles.append(modules[name].register_forward_pre_hook(
            lambda m, a, k, name=name: pre(m, a, k, name), with_kwargs=True))
        handles.append(modules[name].register_forward_hook(post))
    try:
        with on_fake_model(model, "the over-keeping check"), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for h in handles:
            h.remove()
    return kept


def over_kept(model: nn.Module, names: list[str], forward: Callable[[], Any]) -> list[OverKeep]:
    """The layers of ``names`` (wrapped on ``model``) that keep more as installed than without checkpointing,
    in ``names``' order: two forwards on fake tensors, the first with the wrappers off."""
    model = user_module(model)

    def measured() -> tuple[dict[str, int], dict[str, int]]:
        with checkpointing_disabled(model):
            without = kept_by_layer(model, names, forward)
        with compiling_paused(model):  # never compile fake tensors
            return without, kept_by_layer(model, names, forward)

    without, with_ckpt = with_values_replayed(model, forward, measured)  # a forward that reads values too
    modules = dict(model.named_modules())
    return [OverKeep(n, type(modules[n]).__name__, with_ckpt[n], without[n])
            for n in names if with_ckpt[n] > without[n]]


def overkeep_warning(rows: list[OverKeep], how: str) -> str:
    """What a fixed mode that over-keeps is told, naming each layer with its class and both byte counts."""
    return (f"{how} keeps more for backward than no checkpointing on {len(rows)} layer(s): "
            f"{'; '.join(map(str, rows))}. Leave them out of ckpt.layers, try another ckpt.policy, or let "
            "ckpt=auto choose per layer (it keeps a layer rather than checkpoint it so)")


__all__ = ["OverKeep", "kept_by_layer", "over_kept", "overkeep_warning"]

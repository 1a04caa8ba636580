"""What the modules outside ``ckpt.layers`` keep for backward: where "select more layers" should look.

    outside_keepers(model, ["encoder.stages.0.layers.0", ...], forward)   # [("embedder", 98304), ...]

``ckpt=auto`` checkpoints only its candidates; what the rest of the model keeps
stays, whatever the plan. When a budget is refused, or ``ckpt.budget=min``
stops above the forward's own floor, the modules outside the candidates that
keep the most are what to add (a Hugging Face ResNet's embedder, at full
resolution; the example ResNet's stem): this names them, with their bytes.

The modules measured are the largest ones that hold no candidate (a child of
the model beside the blocks, or of a stage the blocks sit in), each with
everything under it; a container that is never called (``ModuleList``) is
looked into instead. Each is measured by what it keeps beyond its own inputs:
what ``full`` on it would free, since a checkpoint keeps its inputs. One
forward on fake tensors, counted as ``saved_bytes`` counts (each storage once,
under the module running when it was first saved).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import storage_key, tree_leaves
from ckpt_plugin.engine.blocks import has_forward
from ckpt_plugin.engine.wrap import checkpointing_disabled
from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.measure.memory import is_parameter

Key = tuple[str, int]  # a storage's identity (``_compat.storage_key``)


def outside(model: nn.Module, names: list[str]) -> list[str]:
    """The largest modules of ``model`` holding none of ``names`` (qualified names), in model order."""
    chosen = set(names)
    found: list[str] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for child, sub in module.named_children():
            name = f"{prefix}.{child}" if prefix else child
            if name in chosen:
                continue
            if any(n.startswith(f"{name}.") for n in chosen) or not has_forward(sub):
                walk(name, sub)
            else:
                found.append(name)

    walk("", model)
    return found


class _Saves:
    """What each watched module saves for backward (each storage once, under the first to save it; parameters
    never), and the storages it was given."""

    def __init__(self, model: nn.Module) -> None:
        self.seen = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.owners: list[str | None] = [None]
        self.saved: dict[str, dict[Key, int]] = defaultdict(dict)
        # Held (fake tensors: no memory) so that no later storage can take an input's id once it dies.
        self.inputs: dict[str, dict[Key, torch.Tensor]] = defaultdict(dict)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if not is_parameter(t) and key not in self.seen:
            self.seen.add(key)
            if self.owners[-1] is not None:
                self.saved[self.owners[-1]][key] = t.untyped_storage().nbytes()
        return t.detach()  # as SavedCounter: a saved output handed back keeps a cycle (pytorch#115255)

    def watch(self, name: str, module: nn.Module, own: bool) -> list[Any]:
        def pre(_m: nn.Module, args: Any, kwargs: Any) -> None:
            self.owners.append(name if own else None)
            if own:
                self.inputs[name] |= {storage_key(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            self.owners.pop()

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, always_call=True)]


def outside_keepers(model: nn.Module, names: list[str], forward: Callable[[], Any]) -> list[tuple[str, int]]:
    """Each module :func:`outside` ``names`` that keeps anything beyond its inputs for backward, with those bytes
    (what checkpointing it would free: a checkpoint keeps its inputs), the most first."""
    roots = outside(model, names)
    modules = dict(model.named_modules())
    saves = _Saves(model)
    handles = [h for n in names for h in saves.watch(n, modules[n], own=False)]  # the candidates' saves are theirs
    handles += [h for r in roots for h in saves.watch(r, modules[r], own=True)]
    try:
        with (checkpointing_disabled(model), on_fake_tensors(model, "what the modules outside ckpt.layers keep"),
              torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t)):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    freed = {r: sum(b for k, b in saves.saved[r].items() if k not in saves.inputs[r]) for r in roots}
    return sorted(((r, b) for r, b in freed.items() if b), key=lambda item: -item[1])


__all__ = ["outside", "outside_keepers"]

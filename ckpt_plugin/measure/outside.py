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
forward on fake tensors, counted by ``saved_bytes`` (each storage once, under
the module running when it was first saved).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ckpt_plugin.engine.blocks import has_forward
from ckpt_plugin.engine.wrap import checkpointing_disabled
from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.measure.memory import saved_bytes


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


def outside_keepers(model: nn.Module, names: list[str], forward: Callable[[], Any]) -> list[tuple[str, int]]:
    """Each module :func:`outside` ``names`` that keeps anything beyond its inputs for backward, with those bytes
    (what checkpointing it would free: a checkpoint keeps its inputs), the most first."""
    roots = outside(model, names)
    with checkpointing_disabled(model), on_fake_tensors(model, "what the modules outside ckpt.layers keep"):
        # The candidates are owners too: what they save is theirs, not the rest's.
        kept = saved_bytes(model, forward, [*names, *roots], beyond_inputs=roots).by_owner
    return sorted(((r, kept[r]) for r in roots if kept.get(r)), key=lambda item: -item[1])


__all__ = ["outside", "outside_keepers"]

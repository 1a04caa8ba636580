"""The table the callback prints: what was wrapped and what that saved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.measure.memory import REST, SavedBytes, saved_bytes
from ckpt_plugin.units import format_bytes
from ckpt_plugin.engine.wrap import checkpointing_disabled, compiled_modules, compiling_paused


@dataclass
class WrapReport:
    """Saved-activation bytes of one forward without and with checkpointing.

    ``note`` is the plan's (``WrapPlan.note``): what ``ckpt.layers=auto`` chose, shown first.
    ``compiled``: the wrapped modules run compiled (``ckpt.compile``); their bytes are counted as they run eagerly.
    """

    model: str
    wrapped: list[str]
    classes: dict[str, str]
    without: SavedBytes
    with_ckpt: SavedBytes
    note: str = ""
    compiled: bool = False

    def __str__(self) -> str:
        rows = [(n, self.classes[n]) for n in self.wrapped] + [(REST, "")]
        w = max(len(r[0]) for r in rows + [("module", "")])
        c = max(len(r[1]) for r in rows + [("", "class")])
        lines = [self.note] if self.note else []
        lines += [
            f"Activation checkpointing wrapped {len(self.wrapped)} module(s) of {self.model}; "
            "saved activations of one forward:",
            f"  {'module':<{w}}  {'class':<{c}}  {'without':>10}  {'with':>10}",
        ]
        for name, cls in rows:
            lines.append(
                f"  {name:<{w}}  {cls:<{c}}  {format_bytes(self.without.by_owner.get(name, 0)):>10}"
                f"  {format_bytes(self.with_ckpt.by_owner.get(name, 0)):>10}"
            )
        before, after = self.without.total, self.with_ckpt.total
        ratio = f"  ({after / before:.0%} of without)" if before else ""
        lines.append(f"  {'total':<{w}}  {'':<{c}}  {format_bytes(before):>10}  {format_bytes(after):>10}{ratio}")
        if self.compiled:
            lines.append("  (counted as the layers run uncompiled: compiled (ckpt.compile), torch's partitioner decides "
                         "what each keeps)")
        return "\n".join(lines)


def wrap_report(model: nn.Module, wrapped: list[str], forward: Callable[[], Any], note: str = "") -> WrapReport:
    """Measure ``forward()`` (one forward of the wrapped ``model``) without and with checkpointing.

    ``note`` (the plan's: what ``ckpt.layers=auto`` chose) heads the report.

    Runs the forward twice on fake tensors (``fake.py``): the bytes are the
    real ones, counted without allocating them, so the report never needs the
    memory of the forward without checkpointing that it reports. No side
    effect on RNG, buffers or gradients; nothing here trains. Raises
    :class:`~ckpt_plugin.measure.fake.NotFakeable` if the forward cannot run
    on fake tensors.
    """
    modules = dict(model.named_modules())
    with on_fake_tensors(model, "The activation report"), checkpointing_disabled(model):
        without = saved_bytes(model, forward, wrapped)
    with on_fake_tensors(model, "The activation report"), compiling_paused(model):  # never compile fake tensors
        with_ckpt = saved_bytes(model, forward, wrapped)
    return WrapReport(
        model=type(model).__name__,
        wrapped=wrapped,
        classes={n: type(modules[n]).__name__ for n in wrapped},
        without=without,
        with_ckpt=with_ckpt,
        note=note,
        compiled=bool(compiled_modules(model)),
    )

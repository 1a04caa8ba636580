"""What stands between a budget and ``ckpt=auto``'s plans, said where a budget is refused or ``min`` is reached.

    raise with_reasons(refused, model, names, forward, budget_bytes, none_peak)   # a refusal that says why
    least_lines(model, names, forward, none_peak)                                 # ckpt.budget=min's two lines

Two things can: the forward itself (``measure/floor.py``: below its own floor
no plan of any mode goes, so choosing more layers is no help), and the modules
outside ``ckpt.layers`` (``measure/outside.py``: what they keep stays, whatever
the plan, so those that keep the most are named, by the name that selects
them). Each is one more forward on fake tensors, run only here; a model that
cannot run on them (rare: the profile before did) is refused as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.floor import Floor, forward_floor
from ckpt_plugin.measure.outside import outside_keepers
from ckpt_plugin.units import format_bytes

SHOWN = 3  # modules outside ckpt.layers named, at most
SHARE = 20  # ... each keeping at least 1/SHARE of the peak without checkpointing beyond its inputs


def with_reasons(refused: ConfigError, model: nn.Module, names: list[str], forward: Callable[[], Any],
                 budget_bytes: int, reference: int) -> ConfigError:
    """``refused`` (a budget ``ckpt=auto`` cannot meet on ``names``) with what stands in the way: below the forward's
    floor, that no plan can meet it; above it, the modules outside ``names`` worth selecting too."""
    explained = with_floor(refused, model, forward, budget_bytes, reference)
    if explained is not refused:
        return explained
    return _added(refused, _outside_sentence(model, names, forward, reference))


def with_floor(refused: ConfigError, model: nn.Module, forward: Callable[[], Any], budget_bytes: int,
               reference: int) -> ConfigError:
    """``refused`` saying, where ``budget_bytes`` is below the forward's own floor, that no plan of any mode meets it
    either; as it is otherwise (the same object)."""
    floor = _floor(model, forward)
    if floor is None or budget_bytes >= floor.bytes:
        return refused
    return _added(refused, f"Nor can any other plan: {floor.sentence(reference)}")


def least_lines(model: nn.Module, names: list[str], forward: Callable[[], Any], reference: int) -> str:
    """``ckpt.budget=min``'s lines: how low any plan could go, and which modules outside ``names`` to select too."""
    floor = _floor(model, forward)
    outside = _outside_sentence(model, names, forward, reference)
    lines = [f"ckpt.budget=min: {floor.sentence(reference)}" if floor is not None else "",
             f"ckpt.budget=min: {outside[0].lower()}{outside[1:]}" if outside else ""]
    return "\n".join(filter(None, lines))


def _added(refused: ConfigError, sentence: str) -> ConfigError:
    """``refused`` with ``sentence`` after its budget problem's message ("" : ``refused`` itself)."""
    if not sentence:
        return refused
    return ConfigError([replace(p, problem=f"{p.problem}. {sentence}") if p.key == "ckpt.budget" else p
                        for p in refused.problems], refused.what)


def _outside_sentence(model: nn.Module, names: list[str], forward: Callable[[], Any], reference: int) -> str:
    """The modules outside ``names`` keeping a share of the peak worth checkpointing too, in a sentence; "": none."""
    try:
        keepers = outside_keepers(model, names, forward)
    except NotFakeable:
        return ""
    shown = [(n, b) for n, b in keepers if b * SHARE >= reference][:SHOWN]
    if not shown:
        return ""
    if len(shown) == 1:
        (name, size), them = shown[0], "it"
        said = (f"{name} keeps {format_bytes(size)} ({size / reference:.2f} of the peak without checkpointing) "
                "beyond its inputs for backward, whatever the plan")
    else:
        each = ", ".join(f"{n} {format_bytes(b)} ({b / reference:.2f}{' of the peak without checkpointing' * (i == 0)})"
                         for i, (n, b) in enumerate(shown))
        said, them = f"{len(shown)} modules keep beyond their inputs for backward, whatever the plan: {each}", "them"
    return (f"Outside ckpt.layers, {said}: add {them} to ckpt.layers (a qualified name is an entry) for "
            f"ckpt=auto to checkpoint {them} too")


def _floor(model: nn.Module, forward: Callable[[], Any]) -> Floor | None:
    try:
        return forward_floor(model, forward)
    except NotFakeable:
        return None


__all__ = ["least_lines", "with_floor", "with_reasons"]

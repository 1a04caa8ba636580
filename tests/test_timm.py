"""``layers=auto`` on timm's models takes what timm's own ``set_grad_checkpointing()`` takes (issue #42).

What timm checkpoints is observed, not written down: with its switch on, the
modules its forward runs again during backward (non-reentrant checkpointing
recomputes a checkpointed call when backward first needs what it saved), the
outermost of them. auto must wrap exactly those, by qualified name. The zoo's
``tests/test_zoo.py`` measures the same entries (bitwise gradients, ours/own
activation peaks at most 1.05). The rule itself, on shapes of timm's nesting in
plain torch, runs without timm.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ckpt_plugin import apply_checkpointing, remove_checkpointing
from ckpt_plugin.engine.selection import resolve_layers
from ckpt_tools.zoo import timm_models

NAMES = list(timm_models.TIMM)
needs_timm = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")


def recomputed(model: nn.Module, batch: dict, loss) -> list[str]:
    """The outermost modules whose forward runs again in backward, in the order backward reruns them."""
    names = {id(m): n for n, m in model.named_modules()}
    in_backward, calls = [False], []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append(names[id(m)]) if in_backward[0] else None)
             for m in model.modules()]
    try:
        out = loss(model(**batch))
        in_backward[0] = True
        out.backward()
    finally:
        for h in hooks:
            h.remove()
    calls = list(dict.fromkeys(calls))
    return [n for n in calls if not any(n.startswith(o + ".") for o in calls)]


@needs_timm
@pytest.mark.parametrize("name", NAMES)
def test_auto_wraps_what_timms_own_switch_checkpoints(name: str) -> None:
    model = timm_models.build(name)
    batch, loss = timm_models._images(), timm_models._loss
    model.set_grad_checkpointing(True)
    theirs = recomputed(model, batch, loss)
    model.set_grad_checkpointing(False)
    assert recomputed(model, batch, loss) == []  # the switch off: nothing runs twice

    classes, note = resolve_layers(model, "auto")
    assert classes == timm_models.TIMM[name][2]
    assert note.startswith(f"ckpt.layers=auto chose {', '.join(classes)} (timm set_grad_checkpointing): ")
    wrapped = apply_checkpointing(model, layers="auto")
    order = [n for n, _ in model.named_modules()]
    assert wrapped == sorted(theirs, key=order.index)
    assert remove_checkpointing(model) == wrapped


@needs_timm
def test_torchvision_imports_with_only_its_missing_ops_skipped() -> None:
    import torchvision
    import torchvision.extension

    from ckpt_tools.torchvision_cpu import SKIPPED

    if torchvision.extension._has_ops():  # a torchvision built for this torch: nothing skipped
        assert SKIPPED == []
        return
    assert SKIPPED == ["torchvision::nms", "torchvision::qnms"]
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):  # its ops still say they are missing
        torchvision.ops.nms(boxes, torch.ones(1), 0.5)


# ---------------------------------------------------------------------- the rule, on timm's nesting in plain torch

def _two_layers(self: nn.Module) -> None:
    nn.Module.__init__(self)
    self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)


def _residual(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + self.fc2(torch.relu(self.fc1(x)))


# Three unrelated classes (a class name selects its subclasses too): the blocks; a block class that occurs once
# (EfficientNet's stage-0 DepthwiseSeparableConv); a one-off module beside the blocks (ViT's attn_pool).
Block, Lone, Pool = (type(name, (nn.Module,), {"__init__": _two_layers, "forward": _residual})
                     for name in ("Block", "Lone", "Pool"))


class Switch(nn.Module):
    """timm's convention: ``set_grad_checkpointing()`` turns on the callers' boolean ``grad_checkpointing``."""

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for m in self.modules():
            if isinstance(getattr(m, "grad_checkpointing", None), bool):
                m.grad_checkpointing = enable


class Stage(nn.Module):
    """A RegNet stage: blocks ``b1``, ``b2`` as named children, all checkpointed."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", Block())
        self.grad_checkpointing = False


def test_timm_callers_choose_every_block_of_their_sequence() -> None:
    class EfficientNetLike(Switch):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.blocks = nn.Sequential(nn.Sequential(Lone()), nn.Sequential(Block(), Block()))
            self.attn_pool = Pool()  # a plain attribute of the caller: runs outside (ViT's attn_pool)
            self.grad_checkpointing = False

    assert resolve_layers(EfficientNetLike(), "auto") == (
        ("Lone", "Block"), "ckpt.layers=auto chose Lone, Block (timm set_grad_checkpointing): 3 modules")
    assert apply_checkpointing(EfficientNetLike(), layers="auto") == ["blocks.0.0", "blocks.1.0", "blocks.1.1"]

    class RegNetLike(Switch):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.s1, self.s2 = Stage(1), Stage(2)

    assert apply_checkpointing(RegNetLike(), layers="auto") == ["s1.b1", "s2.b1", "s2.b2"]  # not s1, s2 whole


def test_grad_checkpointing_without_the_switch_is_no_timm_model() -> None:
    # The flag alone (no set_grad_checkpointing) is not timm's mark: the structure decides, as before.
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s1, self.s2 = Stage(2), Stage(3)

    assert resolve_layers(Plain(), "auto")[1].startswith("ckpt.layers=auto chose Block (repeated blocks)")

"""The forward's own floor: an activation peak no checkpointing of a model can go below.

    floor = forward_floor(model, lambda: model.loss(batch))   # one forward on fake tensors
    floor.bytes, floor.module, floor.op                      # 16777216, 'stages.0.1.bn3', 'aten.native_batch_norm'

Checkpointing changes what a step saves for backward, never what its forward
holds while it runs. While a module runs, whoever called it holds its
arguments (Python's call frames: ``nn.Module.__call__`` keeps ``args`` until
the call returns), and while an op runs, its inputs and its output exist at
once. So at every op of the forward, the storages that the modules on the call
stack were given, with the op's own inputs and outputs, are alive in every
plan: the largest such set, over the forward's ops, is a lower bound of the
activation peak of any schedule (per layer, inside a layer, nested regions,
op groups; anything that does not edit the model's code).

Only storages that ops of the step make are counted, as MemTracker's ``act``
counts them: not the parameters, buffers or the batch. On the example ResNet
this floor is 0.37 of the peak without checkpointing: inside ``stages.0.1``,
``stages`` holds the stem's output and ``stages.0`` holds block 0's output while
BatchNorm reads one 4 MiB tensor and writes another. ``ckpt=auto`` says so when
it refuses a budget below it, and ``ckpt.budget=min`` reports how close it came.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import TorchDispatchMode, is_fake, storage_key, tree_leaves
from ckpt_plugin.engine.wrap import checkpointing_disabled
from ckpt_plugin.measure.fake import fake_measurement
from ckpt_plugin.measure.memory import side_effect_free
from ckpt_plugin.measure.values import with_values_replayed
from ckpt_plugin.units import format_bytes

Key = tuple[str, int]  # a storage's identity (``_compat.storage_key``): shared by views


@dataclass(frozen=True)
class Floor:
    """The forward's floor: ``bytes`` alive while ``op`` runs inside ``module`` (qualified name; the model's own
    class name for the model itself, "" outside every module: the loss), whatever is checkpointed."""

    bytes: int
    module: str
    op: str

    def sentence(self, reference: int) -> str:
        """Why no plan goes below it, in words, with its fraction of ``reference`` (the peak without checkpointing)."""
        where = f"while {self.module} runs {self.op}" if self.module else f"while {self.op} runs outside its modules"
        return (f"no checkpointing of this model goes below {format_bytes(self.bytes)} ({self.bytes} B, "
                f"{self.bytes / reference:.2f}): its forward alone holds that much {where}, the modules it is "
                "called from holding their inputs and the op its inputs and output")


class _Watch(TorchDispatchMode):
    """Samples, at every op, the bytes of the step's storages held by the call stack or by the op."""

    def __init__(self, fake: Any) -> None:
        super().__init__()
        self.fake = fake
        self.made: dict[Key, int] = {}  # storage -> bytes, for storages ops of the step made
        # The fake copies' storages of real tensors (parameters, the batch), held: an id is unique only while
        # its object lives, and a freed copy's id must not make a later storage look like one.
        self.external: dict[Key, torch.Tensor] = {}
        self.stack: list[tuple[str, set[Key]]] = []  # (module, its arguments' storages), outermost first
        self.best = Floor(0, "", "")

    @staticmethod
    def keys(tree: Any) -> set[Key]:
        return {storage_key(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not is_fake(t) and self.fake is not None:
                # A real tensor (parameter, batch) reaches ops as the mode's fake copy (memoised), whose
                # storage a view of it shares: not one the step made.
                copy = self.fake.from_tensor(t)
                self.external[storage_key(copy)] = copy
                self.made.pop(storage_key(copy), None)  # the id of a storage the step made and freed
        out = func(*args, **(kwargs or {}))
        inputs = self.keys((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (k := storage_key(t)) not in inputs and k not in self.external:
                try:
                    st = t.untyped_storage()
                except (NotImplementedError, RuntimeError):  # no storage of its own (a wrapper subclass): uncounted
                    continue
                # As MemTracker: CUDA's caching allocator hands out multiples of 512 bytes.
                self.made[k] = -(-st.nbytes() // 512) * 512 if st.device.type == "cuda" else st.nbytes()
        held = inputs | self.keys(out)
        for _module, keys in self.stack:
            held |= keys
        total = sum(self.made.get(k, 0) for k in held)
        if total > self.best.bytes:
            self.best = Floor(total, self.stack[-1][0] if self.stack else "", f"aten.{func.overloadpacket.__name__}")
        return out


def forward_floor(model: nn.Module, forward: Callable[[], Any], *, fake: bool = True) -> Floor:
    """The forward's floor of ``model`` (see above), from one ``forward()`` on fake tensors (``fake=False``: real
    ones, for tests). The model is left as it was: wrappers, buffers, RNG, gradients. A forward that reads values
    replays what one forward without autograd read (``measure/values.py``)."""
    if fake:
        return with_values_replayed(model, forward, lambda: _floor(model, forward, fake))
    return _floor(model, forward, fake)


def _floor(model: nn.Module, forward: Callable[[], Any], fake: bool) -> Floor:
    names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    with (checkpointing_disabled(model), fake_measurement(model, "the forward's floor") as mode,
          side_effect_free(model)):
        watch = _Watch(mode if fake else None)

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            watch.stack.append((names[id(module)], watch.keys((args, kwargs))))

        def leave(module: nn.Module, args: tuple, output: Any) -> None:
            if watch.stack and watch.stack[-1][0] == names[id(module)]:
                watch.stack.pop()

        handles = []
        try:
            for module in model.modules():
                handles.append(module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
                handles.append(module.register_forward_hook(leave, always_call=True))
            with mode if fake else contextlib.nullcontext(), watch, torch.enable_grad():
                forward()
        finally:
            for handle in handles:
                handle.remove()
    return watch.best


__all__ = ["Floor", "forward_floor"]

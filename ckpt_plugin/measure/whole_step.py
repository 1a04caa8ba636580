"""The whole training step on one rank, as the device holds it: parameters, gradients, optimizer state, activations
and temporaries, measured on fake tensors (``ckpt.memory``; docs/fit-a-gpu.md).

    split = whole_step(model, forward, optimizers)   # on fake tensors: nothing allocated
    split.peak, split.at_peak["grad"], str(split)

The step is Lightning's automatic optimization, in its order
(``lightning/pytorch/loops/optimization/automatic.py``, ``Closure.closure``):
``training_step`` (here ``forward()``, the loss), then ``optimizer.zero_grad()``,
then backward, then ``optimizer.step()``. So the gradients of the step before are
still alive while the forward runs: from the second step on, the forward peaks over
parameters, optimizer state *and* a full set of gradients. The step measured is that
second one: a first step makes the gradients and the optimizer's state (Adam's two
moments, SGD's momentum) as the real first ``step()`` makes them, then MemTracker
(``_compat/memory.py``) follows the second, every category. Both run on fake tensors
(``measure/fake.py``), the user's own optimizer stepping fake copies of its
parameters (its settings, ``foreach`` and ``fused`` included, as they are), so the
bytes are the real ones and nothing is allocated; the optimizer's state and the
parameters' ``.grad`` are put back as they were.

``fake=False`` runs the same two steps on the real tensors (tests and the
exhaustive search of ``ckpt_tools/fit_check.py`` compare the two); it trains:
the caller owns the model.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import CategoryPeakTracker, is_fake
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.units import format_bytes

# MemTracker's categories (``_MemRefType``), as the split names them, in the order it prints them.
CATEGORIES = {"parameter": "parameters", "buffer": "buffers", "gradient": "gradients", "optstate": "optimizer",
              "activation": "activations", "temp": "temporaries", "other": "other"}


@dataclass(frozen=True)
class Held:
    """Bytes on the device through the step that no tensor the measured step makes is, and what holds them: the
    batch (made by the loader before ``training_step``: MemTracker never sees it made) and DDP's gradient buckets
    (``lightning/memory.py``). Added to a step's peak and shown in its split."""

    bytes: int
    by: str


@dataclass(frozen=True)
class StepSplit:
    """The whole step's peak on one device, and what held it at that moment, by MemTracker category.

    ``at_peak``: category (a key of :data:`CATEGORIES`) -> bytes when the total peaked;
    ``peaks``: each category's own peak over the step (activations peak before gradients do).
    """

    peak: int
    at_peak: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    held: tuple[Held, ...] = ()  # included in ``peak``
    # A real step on CUDA: the allocator's peak over the step (``max_memory_allocated``: MemTracker's tensors, the
    # batch and the allocator's rounding to its blocks) and what it had reserved from the device at the end.
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    # Two more moments of the step, by category (and "total"), for a strategy whose step differs from this
    # process's (DeepSpeed ZeRO: apply/zero.py): where the total less the gradients peaked outside the optimizer's
    # step, and where the total peaked inside it.
    gradless: dict[str, int] = field(default_factory=dict)
    in_optimizer: dict[str, int] = field(default_factory=dict)
    gradless_at: dict[int, int] = field(default_factory=dict)  # gradient bytes alive -> the most the rest held
    # What a strategy keeps in host memory at the peak's moment (DeepSpeed's offload: apply/zero.py), said apart:
    # in ``peak`` only where the device is the host (its ``by`` says which).
    offloaded: Held | None = None

    def gradless_after(self, gradients: int) -> int:
        """The most the step held besides its gradients, outside the optimizer's step, once ``gradients`` bytes of
        them had been made (backward makes them in turn): 0 if never."""
        return max((rest for made, rest in self.gradless_at.items() if made >= gradients), default=0)

    def share(self, category: str) -> int:
        return self.at_peak.get(category, 0)

    def holding(self, held: Sequence[Held]) -> StepSplit:
        """This step with ``held`` on the device beside it."""
        held = tuple(h for h in held if h.bytes)
        if not held:
            return self
        return replace(self, peak=self.peak + sum(h.bytes for h in held), held=self.held + held)

    def __str__(self) -> str:
        parts = [f"{CATEGORIES[c]} {format_bytes(b)}" for c, b in self.at_peak.items() if b and c in CATEGORIES]
        parts += [f"{h.by} {format_bytes(h.bytes)}" for h in self.held]
        moved = f"; {self.offloaded.by} {format_bytes(self.offloaded.bytes)}" if self.offloaded else ""
        return f"{format_bytes(self.peak)} ({self.peak} B): " + ", ".join(parts) + moved


Forward = Callable[[], Any]
# A context opened around the two measured steps, on the model as they run it (its fake copies): what a strategy
# does to the module while it runs, played on the fake step (ZeRO-3's gathered parameters: apply/zero3_gather.py).
Around = Callable[[nn.Module], contextlib.AbstractContextManager[Any]]


def whole_step(model: nn.Module, forward: Forward, optimizers: Sequence[torch.optim.Optimizer] = (), *,
               fake: bool = True, what: str = "ckpt.memory's step", moments: bool = False,
               around: Around | None = None) -> StepSplit:
    """The peak of the second of two training steps of ``model`` as it is now (checkpointing installed or not),
    by category; ``forward()`` runs the model on a sample batch (any output: its floating-point tensors are summed,
    as ``ckpt=auto``'s profile does). ``optimizers``: those the step steps (none: parameters, gradients and
    activations only). On fake tensors unless ``fake=False`` (which trains ``model``). ``moments``: the split's
    ``gradless`` and ``in_optimizer`` moments too (a ZeRO rank's model reads them: ``apply/zero.py``). ``around``:
    a context open around the two steps (:data:`Around`)."""
    opened = around or (lambda _model: contextlib.nullcontext())
    if not fake:
        with opened(model):
            return _two_steps(model, forward, optimizers, moments)
    from ckpt_plugin.measure.report import (
        on_fake_model,  # report.py imports the measurements: no cycle at import
    )
    from ckpt_plugin.measure.values import with_values_replayed

    def measured() -> StepSplit:
        with on_fake_model(model, what) as copies, _optimizers_on(optimizers, copies), opened(model):
            return _two_steps(model, forward, optimizers, moments)

    return with_values_replayed(model, forward, measured)


def _two_steps(model: nn.Module, forward: Forward, optimizers: Sequence[torch.optim.Optimizer],
               moments: bool = False) -> StepSplit:
    def step() -> None:
        loss = scalar(forward())
        for optimizer in optimizers:  # Lightning's closure: after training_step, before backward
            optimizer.zero_grad()
        if not optimizers:
            model.zero_grad()
        loss.backward()
        del loss
        for optimizer in optimizers:
            optimizer.step()

    step()  # the gradients and the optimizer's state, as the first real step leaves them
    device = next(model.parameters()).device
    cuda = device.type == "cuda" and not is_fake(next(model.parameters()))
    before = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    tracker = CategoryPeakTracker(moments=moments)
    tracker.track_external(model, *optimizers)
    with tracker:
        # Of what the device held before the step, the step's own (the model, its gradients, the optimizer's
        # state) is MemTracker's at its start; the rest is not the step's (other models alive in the process:
        # the GPU check's bench kept three whole GPTs beside the one measured, 2.4 GB over the step's own peak).
        own = tracker.get_tracker_snapshot().get(device, {}).get("Total", 0) if cuda else 0
        step()
    split = split_of(tracker)
    if cuda:
        torch.cuda.synchronize(device)
        split = replace(split, cuda_allocated=torch.cuda.max_memory_allocated(device) - (before - own),
                        cuda_reserved=torch.cuda.memory_reserved(device))
    return split


def split_of(tracker: CategoryPeakTracker, device: torch.device | None = None) -> StepSplit:
    """What ``tracker`` saw, as a split: the total's peak and the categories at that moment, summed over devices;
    only ``device``'s where one is given and the step also held tensors elsewhere (DeepSpeed's offload keeps the
    optimizer in host memory beside a GPU's step: said apart as ``offloaded``, not in the peak)."""
    snapshot = tracker.get_tracker_snapshot("peak")
    elsewhere = 0
    if device is not None and not all(_same(d, device) for d in snapshot):
        elsewhere = sum(s.get("Total", 0) for d, s in snapshot.items() if not _same(d, device))
        snapshot = {d: s for d, s in snapshot.items() if _same(d, device)}
    at_peak: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = getattr(key, "value", str(key)).lower()
            if name != "total":
                at_peak[name] = at_peak.get(name, 0) + value
    total = sum(s.get("Total", 0) for s in snapshot.values())
    return StepSplit(total, {c: at_peak.get(c, 0) for c in CATEGORIES}, dict(tracker.category_peaks),
                     gradless=dict(tracker.gradless_peak), in_optimizer=dict(tracker.optimizer_peak),
                     gradless_at=dict(tracker.gradless_at),
                     offloaded=Held(elsewhere, "elsewhere (host memory: not counted)") if elsewhere else None)


def _same(one: Any, other: torch.device) -> bool:
    """Whether ``one`` (a snapshot's key) is the memory of ``other``: the host's whatever its index (DeepSpeed names
    it ``cpu:0``, Lightning ``cpu``), a GPU's by its index where both give one."""
    one = torch.device(one)
    return one.type == other.type and (one.type == "cpu" or None in (one.index, other.index)
                                       or one.index == other.index)


def _optimizers_on(optimizers: Sequence[torch.optim.Optimizer],
                   copies: dict[int, torch.Tensor]) -> contextlib.AbstractContextManager[None]:
    """The optimizers stepping the fake copies of their parameters (:func:`optimizers_over`).

    ``copies``: id of a real parameter -> its fake copy (``on_fake_model``). A parameter the model does not
    hold (an optimizer over more than the module) has no copy and stays out of the fake step.
    """
    return optimizers_over(optimizers, lambda i, j, params: [copies[id(p)] for p in params if id(p) in copies])


@contextlib.contextmanager
def optimizers_over(optimizers: Sequence[torch.optim.Optimizer],
                    params: Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]) -> Iterator[None]:
    """The optimizers over other tensors, from no state: ``params(i, j, group_params)`` those of optimizer ``i``'s
    group ``j``; put back as they were (their state, their groups' parameters, their attributes)."""
    saved = [(o, o.state, [g["params"] for g in o.param_groups], dict(o.__dict__)) for o in optimizers]
    try:
        for i, optimizer in enumerate(optimizers):
            optimizer.state = defaultdict(dict)
            for j, group in enumerate(optimizer.param_groups):
                group["params"] = params(i, j, group["params"])
        yield
    finally:
        for optimizer, state, params, attributes in saved:
            optimizer.__dict__.update(attributes)  # step counters an LR scheduler's wrapper keeps
            optimizer.state = state
            for group, kept in zip(optimizer.param_groups, params, strict=True):
                group["params"] = kept


__all__ = ["CATEGORIES", "Around", "Held", "StepSplit", "optimizers_over", "split_of", "whole_step"]

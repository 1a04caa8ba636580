"""One training step measured on fake tensors, without and with checkpointing: the fit-start report and
``ckpt-inspect`` print it.

Each term the report prints ("kept", "without", "with", "(rest of model)",
"activation peak", "saved") is defined once, in docs/measure.md. In short: a
row's bytes are what autograd keeps for backward after one forward (``memory.saved_bytes``),
the activation peak is MemTracker's ``act`` over the whole step, "without" is
the model as it was given (nothing wrapped) and "with" the model as installed.
The activation peak without checkpointing is the quantity ``ckpt.budget``'s
fractions are read against (``ckpt=auto``'s profile measures it the same way,
``planning/recorder.py``), so the report states its ratio of the same two quantities.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import TorchDispatchMode, is_fake, tree_leaves
from ckpt_plugin.engine.wrap import checkpointing_disabled, compiled_modules, compiling_paused
from ckpt_plugin.measure.fake import fake_measurement
from ckpt_plugin.measure.memory import REST, SavedBytes, saved_bytes, side_effect_free, step_memory
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.measure.values import ValueRecord, recorded_values, values_line, with_values_replayed
from ckpt_plugin.units import format_bytes

# The order the options of ckpt=auto are counted in on the "wrapped" line: the most recompute first.
_OPTION_ORDER = ("full", "selective", "selective_nb", "inside", "keep")


@dataclass
class StepMeasure:
    """One training step of a model as it is (checkpointing installed or not), measured on fake tensors."""

    kept: SavedBytes  # kept for backward after the forward, by selected module and REST
    peaks: dict[str, int]  # the step's peak by MemTracker category; ``act``: the activation peak

    @property
    def activation_peak(self) -> int:
        return self.peaks.get("act", 0)


def measure_step(model: nn.Module, loss: Callable[[], Any], names: list[str], *, fake: bool = True,
                 what: str = "The activation report", peaks: bool = True) -> StepMeasure:
    """One step (``loss()``'s forward, then backward from it) of ``model`` as it is now: what the forward keeps,
    attributed to ``names`` (qualified; the rest to REST), and the step's peaks by category.

    ``fake=True`` (the report, ``ckpt-inspect``): on fake tensors, for no memory; the bytes are a real step's.
    ``fake=False``: a real step (on CUDA, the peaks are the allocator's: ``total`` and ``act`` above what was
    allocated before). ``what`` names the measurement in :class:`NotFakeable`. ``loss()`` may return any output: its floating-point tensors are summed
    (``sample.scalar``), as ``ckpt=auto``'s profile does. No trace on RNG, buffers or gradients.
    ``peaks=False``: the kept bytes alone (one forward; no MemTracker, no backward): what the callback's report
    needs for every mode but ``ckpt=auto``, whose plan it compares with the peaks.
    """
    if fake:  # a forward that reads values: fake runs replay what it read (measure/values.py)
        return with_values_replayed(model, loss, lambda: _measured_step(model, loss, names, fake, what, peaks))
    return _measured_step(model, loss, names, fake, what, peaks)


def _measured_step(model: nn.Module, loss: Callable[[], Any], names: list[str], fake: bool, what: str,
                   peaks: bool) -> StepMeasure:
    def step() -> None:
        scalar(loss()).backward()
        model.zero_grad(set_to_none=True)

    device = next(model.parameters()).device
    measuring = (lambda: on_fake_model(model, what)) if fake else (lambda: side_effect_free(model))
    # Two runs: the kept bytes' hooks hand autograd detached aliases, and MemTracker would count the alias of a
    # tensor it never saw made (the batch's fake copy) as an activation of the step.
    with measuring():
        kept = saved_bytes(model, loss, names)
    if not peaks:
        return StepMeasure(kept, {})
    with measuring():
        grads = {p: p.grad for p in model.parameters()}
        try:
            peaks = _cuda_peaks(step, device) if device.type == "cuda" and not fake else step_memory(step, model)
        finally:
            for p, g in grads.items():
                p.grad = g
    return StepMeasure(kept, peaks)


def _cuda_peaks(step: Callable[[], None], device: torch.device) -> dict[str, int]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return {"total": torch.cuda.max_memory_allocated(device), "act": torch.cuda.max_memory_allocated(device) - base}


@contextlib.contextmanager
def on_fake_model(model: nn.Module, what: str) -> Iterator[dict[int, torch.Tensor]]:
    """``on_fake_tensors`` with the model's parameters and buffers swapped for their fake copies (yielded: id of
    the real tensor -> its copy, for an optimizer to step them: ``whole_step.py``).

    ``on_fake_tensors`` converts parameters, buffers and the batch on use, and
    the mode memoises the copies weakly. Bytes saved and FLOPs come out exact
    that way, but not ``MemTracker``'s peaks: a view of a parameter
    (``weight.t()`` for a matmul) is a view of its copy, a storage MemTracker
    has never seen as a parameter, so it files it as an activation (the test
    GPT's activation peak came out 54 % high); and the copy of a batch tensor
    dies with the last op that reads it, where the real batch lives on (256 B
    low). So the module attributes hold the fake copies while the step runs
    (put back after), and the copy of every other real tensor an op reads is
    kept alive until the end, as the real tensor is.
    """
    slots = [(m, name, t) for m in model.modules()
             for name, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]
    with fake_measurement(model, what) as mode, side_effect_free(model), mode, _KeepCopies(mode):
        copies = {id(t): mode.from_tensor(t) for _m, _name, t in slots}  # tied weights stay tied: one copy
        try:
            for m, name, t in slots:
                setattr(m, name, copies[id(t)])
            yield copies
        finally:
            for m, name, t in slots:
                setattr(m, name, t)


class _KeepCopies(TorchDispatchMode):
    """Keeps the fake copy of every real tensor an op reads (the batch) alive while it is in force."""

    def __init__(self, mode: Any) -> None:
        super().__init__()
        self.mode = mode
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (real, its copy): both held

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not is_fake(t) and id(t) not in self.copies:
                self.copies[id(t)] = (t, self.mode.from_tensor(t))  # the copy the op will get: memoised
        return func(*args, **(kwargs or {}))


def how_wrapped(mode: str, options: dict[str, str] | None = None) -> str:
    """The mode, as the "wrapped" line names it: ``ckpt=full``; for ckpt=auto the options it chose, counted
    (``ckpt=auto: 2 full, 1 selective, 1 keep``)."""
    if not options:
        return f"ckpt={mode}"
    counts = Counter(options.values())
    order = [*_OPTION_ORDER, *sorted(set(counts) - set(_OPTION_ORDER))]
    return f"ckpt={mode}: " + ", ".join(f"{counts[o]} {o}" for o in order if counts[o])


def wrapped_line(count: int, model: str, how: str) -> str:
    """The first line of every account of what was wrapped: the count, the model and the mode."""
    return f"Activation checkpointing wrapped {count} module(s) of {model} ({how})"


@dataclass
class WrapReport:
    """One step without and with checkpointing, by selected layer (terms: docs/measure.md).

    ``rows``: the selected layers, those ckpt=auto kept unwrapped included (``options``: each one's option), so
    that REST is everything outside the selection, as in the plan; ``wrapped``: those wrapped.
    ``peaks``: the activation peak without and with. ``planned``: ckpt=auto's (predicted peak, budget bytes).
    ``note`` is the plan's (``WrapPlan.note``): what ``ckpt.layers=auto`` chose, shown first.
    ``compiled``: the wrapped modules run compiled (``ckpt.compile``); their bytes are counted as they run eagerly.
    """

    model: str
    wrapped: list[str]
    classes: dict[str, str]
    without: SavedBytes
    with_ckpt: SavedBytes
    peaks: tuple[int, int] = (0, 0)
    how: str = "ckpt=full"
    rows: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)
    planned: tuple[int, int] | None = None
    note: str = ""
    compiled: bool = False
    values: ValueRecord | None = None  # what a forward that reads values read, replayed on fake tensors
    budget_is: str = "ckpt.budget"  # what ``planned``'s budget is (ckpt.memory: the activation budget it chose)

    @property
    def saved(self) -> int:
        """What checkpointing saves: kept without minus kept with."""
        return self.without.total - self.with_ckpt.total

    def __str__(self) -> str:
        names = self.rows or self.wrapped
        option = bool(self.options)
        rows = [(n, self.classes[n], self.options.get(n, "")) for n in names] + [(REST, "", "")]
        w = max(len(r[0]) for r in rows + [("module", "", "")])
        c = max(len(r[1]) for r in rows + [("", "class", "")])
        o = max(len(r[2]) for r in rows + [("", "", "option")]) + 2 if option else 0
        head = "option" if option else ""
        lines = [self.note] if self.note else []
        lines += [
            f"{wrapped_line(len(self.wrapped), self.model, self.how)}; kept for backward after one forward:",
            f"  {'module':<{w}}  {'class':<{c}}  {head:<{o}}{'without':>10}  {'with':>10}",
        ]
        for name, cls, opt in rows:
            lines.append(
                f"  {name:<{w}}  {cls:<{c}}  {opt:<{o}}{format_bytes(self.without.by_owner.get(name, 0)):>10}"
                f"  {format_bytes(self.with_ckpt.by_owner.get(name, 0)):>10}"
            )
        before, after = self.without.total, self.with_ckpt.total
        lines.append(f"  {'total':<{w}}  {'':<{c}}  {'':<{o}}{format_bytes(before):>10}  {format_bytes(after):>10}"
                     f"  (saved {format_bytes(self.saved)})")
        if self.values is not None:
            lines.append(f"  {values_line(self.values)}")
        peak0, peak1 = self.peaks
        if peak0:
            lines.append(f"  activation peak: {format_bytes(peak0)} without, {format_bytes(peak1)} with "
                         f"({peak1 / peak0:.2f} of without)")
        if self.planned is not None and not peak0:
            lines.append(f"  ckpt=auto planned {format_bytes(self.planned[0])} for {self.budget_is} "
                         f"{format_bytes(self.planned[1])}")
        if self.planned is not None and peak0:
            predicted, budget = self.planned
            lines.append(f"  ckpt=auto planned {format_bytes(predicted)} for {self.budget_is} {format_bytes(budget)} "
                         f"({budget / peak0:.2f} of without)")
        if self.compiled:
            lines.append("  (counted as the layers run uncompiled: compiled (ckpt.compile), torch's partitioner decides "
                         "what each keeps)")
        return "\n".join(lines)


def wrap_report(model: nn.Module, wrapped: list[str], forward: Callable[[], Any], note: str = "", *,
                how: str = "ckpt=full", rows: list[str] | None = None, options: dict[str, str] | None = None,
                without: StepMeasure | None = None, planned: tuple[int, int] | None = None,
                peaks: bool = True) -> WrapReport:
    """Measure one step of ``forward()`` (a forward of the wrapped ``model``) without and with checkpointing.

    ``without``: the step measured before anything was installed (the callback measures it so, once: an
    installation also changes what it does not wrap, e.g. it turns a Hugging Face model's KV cache off);
    None: measured here with the wrappers taken off. ``rows`` (default ``wrapped``): the selected layers;
    ``how``, ``options``, ``planned``, ``note``: as :class:`WrapReport` shows them. ``peaks=False``: kept bytes
    only (``measure_step``).

    On fake tensors (``measure_step``): the bytes are the real ones, counted
    without allocating them, so the report never needs the memory of the step
    without checkpointing that it reports. No side effect on RNG, buffers or
    gradients; nothing here trains. Raises
    :class:`~ckpt_plugin.measure.fake.NotFakeable` if the forward cannot run on fake tensors.
    """
    return with_values_replayed(model, forward, lambda: _wrap_report(
        model, wrapped, forward, note, how=how, rows=rows, options=options, without=without, planned=planned,
        peaks=peaks))


def _wrap_report(model: nn.Module, wrapped: list[str], forward: Callable[[], Any], note: str, *, how: str,
                 rows: list[str] | None, options: dict[str, str] | None, without: StepMeasure | None,
                 planned: tuple[int, int] | None, peaks: bool) -> WrapReport:
    rows = list(rows or wrapped)
    modules = dict(model.named_modules())
    if without is None:
        with checkpointing_disabled(model):
            without = measure_step(model, forward, rows, peaks=peaks)
    with compiling_paused(model):  # never compile fake tensors
        with_ckpt = measure_step(model, forward, rows, peaks=peaks)
    return WrapReport(
        model=type(model).__name__,
        wrapped=wrapped,
        classes={n: type(modules[n]).__name__ for n in rows},
        without=without.kept,
        with_ckpt=with_ckpt.kept,
        peaks=(without.activation_peak, with_ckpt.activation_peak),
        how=how,
        rows=rows,
        options=dict(options or {}),
        planned=planned,
        note=note,
        compiled=bool(compiled_modules(model)),
        values=recorded_values(model),
    )


__all__ = ["StepMeasure", "WrapReport", "how_wrapped", "measure_step", "on_fake_model", "wrap_report",
           "wrapped_line"]

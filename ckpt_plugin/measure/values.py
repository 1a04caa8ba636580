"""Forwards that read values, measured on fake tensors all the same: record what they read, replay it.

Fake tensors carry shapes, not values, so a forward that reads one (``if not
padding_mask.any()``, ``.item()``, ``x[mask]``, ``nonzero``, ``torch.unique``,
routing tokens to experts) stops a fake run where it reads: there is nothing
to read. Such forwards are everyday training code: padding checks, sparse
graphs (torch_geometric drops self-loops through a boolean mask), mixtures of
experts.

What they read depends on the batch's values and the parameters', not on
autograd: so the forward runs once on the real tensors *without autograd*
(``torch.no_grad``: nothing is kept for backward, each op's output is freed
when the next no longer needs it), and every op that reads values records its
answer: the number ``.item()`` gave, the shape of what ``nonzero`` found, and
how many elements each boolean mask used as an index selected. The fake runs
then replay those answers: where a fake op cannot answer, the recorded answer
for the same call is used, and the run goes on with shapes as the real step
has them, so bytes and FLOPs are exact again. Backward's own reads come from
the masks' counts: ``x[mask] = v`` has ``grad[mask]`` as its backward.

The same call is the same op on inputs of the same shapes, made from the same
line of code, in the same module of the model (found from torch's own frames:
``nn.Module``'s call, or checkpoint's recomputation), the n-th time since the
run entered its forward or backward: so each layer's reads are its own, a
recomputation in backward meets its layer's answers again, and a loop in one
layer (one ``nonzero`` per expert) gets one answer per pass. A call the
recording never met cannot be replayed: it raises, naming the op and the module.

The recording runs only when a fake run has failed on a read (a value-free
forward never pays for it), once per measurement (:func:`with_values_replayed`),
with buffers and RNG left as they were. Its own peak (MemTracker's total less
the parameters and buffers) is kept as :attr:`ValueRecord.peak_bytes`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ckpt_plugin._compat import (
    CategoryPeakTracker,
    StorageWeakRef,
    TorchDispatchMode,
    fake_read_error,
    in_backward,
    module_running,
    reads_values,
    storage_key,
    tree_leaves,
    tree_map,
)
from ckpt_plugin.measure.memory import side_effect_free
from ckpt_plugin.units import format_bytes

log = logging.getLogger("ckpt_plugin")

T = TypeVar("T")

_SKIPPED = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)), contextlib.__file__)

Key = tuple[str, str, str, tuple]  # (op, module, "file:line", input shapes)


class UnreplayableRead(RuntimeError):
    """A read a fake run made that the recording has no answer for (made in backward, or on other shapes)."""


@dataclass(frozen=True)
class _TensorAnswer:
    """What a read made, as a fake run needs it: the tensor's shape, strides, dtype and device."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class ValueRecord:
    """What one forward read from values: per call, its answers in order; the recording's own peak."""

    answers: dict[Key, list[_Call]] = field(default_factory=dict)
    peak_bytes: int = 0  # the no-grad forward's peak, parameters and buffers aside

    @property
    def reads(self) -> int:
        """How many reads the forward made (indexing by a mask aside)."""
        return sum(c.answer is not None for calls in self.answers.values() for c in calls)


class _Where:
    """The call site of an op: the model's innermost module on the Python stack, and the line that called torch."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Key:
        line, module = "", None
        frame = sys._getframe(2)
        while frame is not None and module is None:
            if not line and not frame.f_code.co_filename.startswith(_SKIPPED):
                line = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            owner = module_running(frame)  # called, or recomputed by checkpoint: the same module either way
            if owner is not None and id(owner) in self.names:
                module = self.names[id(owner)]
            frame = frame.f_back
        shapes = tuple(tuple(a.shape) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        return (str(func), module if module is not None else "", line, shapes)


@dataclass(frozen=True)
class _Call:
    """One call's record: the answer of a read (``None``: not a read), how many elements each mask selected."""

    answer: Any
    selected: tuple[int, ...] = ()


def indexes_by_mask(func: Any) -> bool:
    """An op that may take a boolean mask as an index (``x[mask]``, ``x[mask] = v``): its backward
    (``grad[mask]``) reads the mask again, a read the forward without autograd never makes."""
    return func.name() in _INDEXING


_INDEXING = ("aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_")


def _masks(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dtype == torch.bool]


class _Recording(TorchDispatchMode):
    """On real tensors: each op that reads values runs, and its answer is kept under its call."""

    def __init__(self, model: nn.Module, record: ValueRecord) -> None:
        super().__init__()
        self.where, self.record = _Where(model), record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads, indexes = reads_values(func), indexes_by_mask(func)
        if reads or indexes:
            selected = tuple(int(m.sum()) for m in _masks(args, kwargs)) if indexes else ()
            call = _Call(tree_map(_answer, out) if reads else None, selected)
            self.record.answers.setdefault(self.where(func, args, kwargs), []).append(call)
        return out


def _place(t: torch.Tensor) -> tuple:
    return (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _contiguous(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> _TensorAnswer:
    stride, step = [], 1
    for size in reversed(shape):
        stride.insert(0, step)
        step *= max(size, 1)
    return _TensorAnswer(tuple(shape), tuple(stride), dtype, device)


def _answer(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorAnswer(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


class Replay:
    """A fake mode's answers to the reads it cannot make: :class:`ValueRecord`'s, call by call."""

    def __init__(self, model: nn.Module, record: ValueRecord) -> None:
        self.where, self.record = _Where(model), record
        self.taken: dict[Key, int] = {}
        self.backward: bool | None = None
        self.depth = 0  # reads being answered: one inside another's fake run is the other's
        # A fake mask's place (storage, offset, shape, strides: autograd may save an alias of it) -> (its storage,
        # weakly, and the elements it selects)
        self._selected: dict[tuple, tuple[StorageWeakRef, int]] = {}

    def reads(self, func: Any) -> bool:
        """The calls the fake mode hands to :meth:`answer`: reads, and indexing that may take a mask."""
        return reads_values(func) or indexes_by_mask(func)

    def answer(self, func: Any, args: tuple, kwargs: dict, run_fake: Callable[[], Any],
               empty: Callable[[_TensorAnswer], torch.Tensor]) -> Any:
        """The fake op's own answer where it has one (a read it can make), else the recorded one.

        A read inside another's fake run (``x[mask]`` runs ``nonzero`` on fake tensors, where the
        real kernel does it below the dispatcher) is not a call of the forward's: it runs as it is,
        and the outer read falls back to its recorded answer.
        """
        if self.depth:
            return run_fake()
        call = self._take(func, args, kwargs)
        if call is not None and call.selected:  # the masks' counts, for a backward's grad[mask]
            for mask, n in zip(_masks(args, kwargs), call.selected):
                self._selected[_place(mask)] = (StorageWeakRef(mask.untyped_storage()), n)
        self.depth += 1
        try:
            return run_fake()
        except Exception as err:
            if not fake_read_error(err):
                raise
            answer = call.answer if call is not None else self._by_mask(func, args)
            if answer is None:
                raise UnreplayableRead(self._unmet(func, args, kwargs)) from err
            err.__traceback__ = None  # its frames hold the fake run's tensors: free them before the answer is made
        finally:
            self.depth -= 1
        return tree_map(lambda a: empty(a) if isinstance(a, _TensorAnswer) else a, answer)

    def _by_mask(self, func: Any, args: tuple) -> _TensorAnswer | None:
        """``x[mask]`` or ``nonzero(mask)`` on a mask whose count a recorded call gave (autograd's backward of
        ``x[mask] = v`` and of ``x[mask]``); None for any other call."""
        if func.name() == "aten::nonzero" and self.selected(args[0]) is not None:
            return _contiguous((self.selected(args[0]), args[0].dim()), torch.long, args[0].device)
        if func.name() != "aten::index.Tensor" or not args[1]:
            return None
        x, indices = args[0], list(args[1])
        masks = [i for i, t in enumerate(indices) if t is not None]
        if len(masks) != 1 or self.selected(indices[masks[0]]) is None:
            return None
        k, mask = masks[0], indices[masks[0]]
        shape = (*x.shape[:k], self.selected(mask), *x.shape[k + mask.dim():])
        return _contiguous(shape, x.dtype, x.device)

    def selected(self, mask: torch.Tensor) -> int | None:
        """How many elements ``mask`` (a fake tensor) selects, if a recorded call said."""
        ref, n = self._selected.get(_place(mask), (None, 0))
        return n if ref is not None and not ref.expired() else None

    def _take(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The recorded answer of this call (``None``: never met), moving on to the next one."""
        backward = in_backward()
        if backward != self.backward:  # a new phase: each call's answers from the first again
            self.backward, self.taken = backward, {}
        key = self.where(func, args, kwargs)
        answers = self.record.answers.get(key)
        if not answers:
            return None
        n = self.taken.get(key, 0)
        self.taken[key] = n + 1
        return answers[n % len(answers)]

    def _unmet(self, func: Any, args: tuple, kwargs: dict) -> str:
        op, module, line, shapes = self.where(func, args, kwargs)
        where = f"module {module!r}" if module else "the model's top level"
        phase = " in backward" if in_backward() else ""
        return (f"{op}{phase} in {where} ({line or 'torch'}, inputs {list(shapes)}) reads values, and the forward "
                "run without autograd never made that call")


_ACTIVE: contextvars.ContextVar[tuple[nn.Module, ValueRecord] | None] = contextvars.ContextVar(
    "ckpt_value_record", default=None)


def active_replay(model: nn.Module) -> Replay | None:
    """A fresh :class:`Replay` of the record in force for ``model`` (:func:`with_values_replayed`), if any."""
    active = _ACTIVE.get()
    if active is None or active[0] is not model or active[1] is None:
        return None
    return Replay(model, active[1])


_RECORDED: weakref.WeakKeyDictionary[nn.Module, ValueRecord] = weakref.WeakKeyDictionary()


def recorded_values(model: nn.Module) -> ValueRecord | None:
    """The last record :func:`with_values_replayed` made of ``model``'s forward (``None``: it never needed one)."""
    return _RECORDED.get(model)


def values_line(record: ValueRecord) -> str:
    """What the report and the plan say of a forward that reads values."""
    return (f"the forward reads values ({record.reads} read{'s' * (record.reads != 1)}): one forward without "
            f"autograd recorded them (its peak {format_bytes(record.peak_bytes)} beside the parameters), and the "
            "measurements on fake tensors replayed them")


class _ListsElementwise(TorchFunctionMode):
    """``tensor.tolist()`` element by element while recording. On a real CPU tensor it reads memory below the
    dispatcher (no op a dispatch mode sees), while on a fake tensor it unbinds and reads each element
    (``aten._local_scalar_dense`` per 0-dim element): so the recording makes the fake path's calls, in its order,
    and each gets its answer (MONAI's ``DiceLoss`` reads ``torch.arange(2, len(input.shape)).tolist()``)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.tolist and args and isinstance(args[0], torch.Tensor):
            return _elementwise(args[0])
        return func(*args, **(kwargs or {}))


def _elementwise(t: torch.Tensor) -> Any:
    return t.item() if t.dim() == 0 else [_elementwise(e) for e in t.unbind(0)]


def record_values(model: nn.Module, forward: Callable[[], Any]) -> ValueRecord:
    """Run ``forward()`` once on real tensors without autograd, recording what it read from values."""
    record = ValueRecord()
    tracker = CategoryPeakTracker()
    tracker.track_external(model)
    with side_effect_free(model), torch.no_grad(), tracker, _Recording(model, record), _ListsElementwise():
        forward()
    peaks = tracker.category_peaks
    record.peak_bytes = max(peaks.get("total", 0) - peaks.get("parameter", 0) - peaks.get("buffer", 0), 0)
    return record


def with_values_replayed(model: nn.Module, forward: Callable[[], Any], measure: Callable[[], T]) -> T:
    """``measure()``, whose fake runs of ``model`` (``forward``) replay what a real no-grad forward read.

    ``measure()`` runs as it is first; only if a fake run stopped on a read is
    the forward recorded (:func:`record_values`) and ``measure()`` run again,
    with every fake run inside replaying the record. Nested calls for the
    same model share the outer one's record.
    """
    active = _ACTIVE.get()
    if active is not None and active[0] is model:  # an outer call records, if a read needs it
        return measure()
    token = _ACTIVE.set((model, None))
    try:
        return measure()
    except RuntimeError as err:  # measure/fake.py's NotFakeable, marked when a recorded forward may answer
        if not getattr(err, "reads_values", False):
            raise
    finally:
        _ACTIVE.reset(token)
    record = _RECORDED[model] = record_values(model, forward)
    log.info("ckpt_plugin: %s: %s", type(model).__name__, values_line(record))
    token = _ACTIVE.set((model, record))
    try:
        return measure()
    finally:
        _ACTIVE.reset(token)


__all__ = [
    "Replay", "UnreplayableRead", "ValueRecord", "active_replay", "record_values", "recorded_values",
    "values_line", "with_values_replayed",
]

"""``saved_activations``: what autograd keeps for backward, row by row (JAX's ``print_saved_residuals``).

    from ckpt_plugin import saved_activations

    print(saved_activations(model, idx))                 # a module: rows sourced to module paths
    print(saved_activations(checkpoint(f), W1, W2, x))   # a function transform: only the inputs stay

The forward runs on fake tensors (``measure/fake.py``): shapes, dtypes and
storage sizes are the real ones, nothing is allocated, so a model can be
inspected at a batch whose un-checkpointed forward would not fit, and the
rows are those of a real run (``tests/test_residuals.py`` compares them on
the GPT, the ResNet and a Hugging Face GPT-2). The table shows no values:
fake tensors have none. Code that asks whether a tensor is fake takes its
cautious path (transformers keeps an all-ones attention mask it would drop
for SDPA's ``is_causal``), and its rows are that path's. ``fake=False`` runs
on real tensors, for comparison.

One forward of ``fn(*args, **kwargs)`` runs with grad enabled under a pair of
``saved_tensors_hooks`` that record every tensor autograd packs, one row per
storage (a view and its base count once), as ``measure.saved_bytes`` counts
them. Where each storage comes from is found by three witnesses:

- arguments of ``fn``, bound to its signature (a module's: its ``forward``'s), by name;
- parameters and buffers, by qualified name: model state, kept anyway, so marked
  apart (``is_parameter``) and left out of ``total_bytes``;
- everything else by the op that produced it, seen by a ``TorchDispatchMode``,
  and the module running at the time, seen by global module forward hooks
  (outside modules: the Python function that called the op).

Checkpointed regions (``checkpoint``, ``apply_checkpointing``, non-reentrant
``torch.utils.checkpoint``) save nothing through the outer hooks but their
inputs; those rows read "input of checkpointed blocks.1" (or "argument x").
The forward leaves RNG streams and buffers as it found them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ckpt_plugin._compat import (
    TorchDispatchMode,
    checkpoint_placeholder,
    checkpointed_fn,
    is_fake,
    is_mutable,
    keystr,
    register_module_forward_hook,
    register_module_forward_pre_hook,
    storage_key,
    tree_flatten_with_path,
    tree_leaves,
)
from ckpt_plugin.measure.fake import fake_measurement
from ckpt_plugin.measure.memory import side_effect_free
from ckpt_plugin.measure.values import with_values_replayed
from ckpt_plugin.units import format_bytes

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# ckpt_plugin/, not this file's measure/: frames in engine/ (policies' dispatch modes) are ours too.
# The examples (ckpt_examples/) are outside it, so their functions are callers like the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class SavedRow:
    """One storage autograd keeps for backward."""

    source: str  # "argument x", "parameter blocks.0.attn.qkv.weight", "blocks.0.mlp.fc aten.addmm", ...
    shape: tuple[int, ...]  # of the tensor that owns the storage (the argument, the op's output)
    dtype: torch.dtype
    bytes: int  # the whole storage's nbytes, as measure.saved_bytes counts it
    is_parameter: bool = False  # a parameter or buffer: model state, not in total_bytes


@dataclass
class SavedActivations:
    """What one forward of ``name`` leaves for backward; ``str()`` is a table."""

    name: str
    rows: list[SavedRow] = field(default_factory=list)
    output_requires_grad: bool = True

    @property
    def total_bytes(self) -> int:
        """Bytes kept for backward, parameters and buffers excluded (``measure.saved_bytes``)."""
        return sum(r.bytes for r in self.rows if not r.is_parameter)

    @property
    def parameter_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.is_parameter)

    def __str__(self) -> str:
        kept = [r for r in self.rows if not r.is_parameter]
        state = [r for r in self.rows if r.is_parameter]
        cells = [(_short(r), format_bytes(r.bytes), r.source) for r in kept + state]
        w = max([len(c[0]) for c in cells] + [len("parameters")])
        b = max([len(c[1]) for c in cells] + [len("bytes")])
        lines = [
            f"saved_activations({self.name}): what autograd keeps for backward after one forward",
            f"  {'saved':<{w}}  {'bytes':>{b}}  source",
        ]
        lines += [f"  {s:<{w}}  {n:>{b}}  {src}" for s, n, src in cells[: len(kept)]]
        total = format_bytes(self.total_bytes)
        exact = f" ({self.total_bytes:,} B)" if self.total_bytes >= 1024 else ""
        lines.append(f"  {'total':<{w}}  {total:>{b}}  {len(kept)} tensor(s){exact}")
        if state:
            lines.append("  model state, kept anyway (not in the total):")
            lines += [f"  {s:<{w}}  {n:>{b}}  {src}" for s, n, src in cells[len(kept):]]
            lines.append(f"  {'parameters':<{w}}  {format_bytes(self.parameter_bytes):>{b}}  {len(state)} tensor(s)")
        if not self.rows and not self.output_requires_grad:
            lines.append("  (the output does not require grad: pass tensors with requires_grad=True)")
        return "\n".join(lines)


def saved_activations(fn: Any, /, *args: Any, fake: bool = True, **kwargs: Any) -> SavedActivations:
    """Run ``fn(*args, **kwargs)`` once and report what autograd keeps for its backward.

    ``fn`` is a function, a module or a module's bound method (``model.loss``).
    Tensors count as autograd sees them: an argument that does not require
    grad is saved only where another input's gradient needs it. Storages are
    counted once; ``total_bytes`` equals ``measure.saved_bytes(...).total``.

    ``fake=True`` (the default) runs the forward on fake tensors: the same rows
    for almost no memory. A forward that reads values (``.item()``, branching
    on data) runs too: the fake run replays what one real run without autograd
    read (``measure/values.py``). ``fake=False`` runs it on real tensors. (As
    ``torch.utils.checkpoint.checkpoint``'s own keywords, ``fake`` is not passed on to ``fn``: wrap ``fn`` in
    ``functools.partial`` to give it a keyword of that name.)
    """
    if not callable(fn):
        raise TypeError(f"saved_activations expects a function or module to run, got {type(fn).__name__}")
    model = _root(fn) or nn.Module()
    if fake:  # a forward that reads values: the fake run replays what one real run without autograd read
        return with_values_replayed(model, lambda: fn(*args, **kwargs),
                                    lambda: _saved_activations(fn, args, kwargs, model, fake))
    return _saved_activations(fn, args, kwargs, model, fake)


def _saved_activations(fn: Any, args: tuple, kwargs: dict, model: nn.Module, fake: bool) -> SavedActivations:
    with contextlib.ExitStack() as restore:
        mode = None
        if fake:  # outermost: turns an error that fake tensors caused into NotFakeable
            mode = restore.enter_context(fake_measurement(model, f"saved_activations({_label(fn)})"))
        recorder = _Recorder(fn, args, kwargs, restore, mode)  # clones buffers: before the mode is entered
        if mode is not None:
            restore.enter_context(mode)
        handles = [
            register_module_forward_pre_hook(recorder.enter_module),
            register_module_forward_hook(recorder.exit_module, always_call=True),
        ]
        try:
            hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack)
            with torch.enable_grad(), hooks, _Producers(recorder):
                out = recorder.run()
            requires_grad = any(t.requires_grad for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            del out  # drops the graph and with it what was saved
        finally:
            for h in handles:
                h.remove()
    return SavedActivations(recorder.label, recorder.rows(), requires_grad)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _Recorder:
    """The state of one ``saved_activations`` call; nothing outlives it."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict, restore: contextlib.ExitStack, mode: Any = None) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.restore = restore  # where the buffers (and RNG) of every module that runs are restored
        self.mode = mode  # the FakeTensorMode the forward runs in, or None: real tensors
        # Real tensor -> (itself, its fake copy), kept alive: storages are keyed by the fake copy's
        # Python storage object, whose id a dead copy would hand on (see key()).
        self.fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.root = _root(fn)
        self.label = _label(fn)
        self.module_names: dict[nn.Module, str] = {}
        self.state: dict[tuple[str, int], tuple[str, tuple[int, ...], torch.dtype]] = {}  # params, buffers
        self.arguments: dict[tuple[str, int], tuple[int, str, torch.Tensor]] = {}
        # storage -> (source, shape, dtype, written in place)
        self.producers: dict[tuple[str, int], tuple[str, tuple[int, ...], torch.dtype, bool]] = {}
        self.modules: list[str] = []  # paths of the modules running now, innermost last
        self.saved: dict[tuple[str, int], tuple[tuple[int, int], SavedRow]] = {}
        restore.enter_context(side_effect_free(self.root or nn.Module()))
        if self.root is not None:
            self._adopt(self.root, prefix="")
        for i, (name, t) in enumerate(_bound_tensors(fn, args, kwargs)):
            self.arguments.setdefault(self.key(t), (i, name, t))

    def run(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def key(self, t: torch.Tensor) -> tuple[str, int]:
        """The storage of ``t`` as the forward sees it.

        On fake tensors the ops see real parameters, buffers and arguments
        through fake copies (one per real tensor, memoised by the mode), and
        autograd saves sometimes the real tensor, sometimes a view of its
        copy: both are keyed by the copy, so that they count once.
        """
        if self.mode is None or is_fake(t):
            return storage_key(t)
        if id(t) not in self.fakes:
            self.fakes[id(t)] = (t, self.mode.from_tensor(t))
            # Its copy's storage may have the id of one an op made and that died already (a closure's
            # tensor, first seen mid-forward): that op is not where it comes from.
            self.producers.pop(storage_key(self.fakes[id(t)][1]), None)
        return storage_key(self.fakes[id(t)][1])

    # -- where a storage comes from --------------------------------------------------------

    def _adopt(self, module: nn.Module, prefix: str) -> None:
        """Name ``module``'s subtree, its parameters and buffers."""

        def join(name: str) -> str:
            return f"{prefix}.{name}" if prefix and name else prefix or name

        for name, m in module.named_modules():
            self.module_names.setdefault(m, join(name) or type(module).__name__)
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, t in named:
                self.state.setdefault(self.key(t), (f"{kind} {join(name)}", tuple(t.shape), t.dtype))

    def module_name(self, module: nn.Module) -> str:
        if module not in self.module_names:  # called by a plain function: named from its class
            self._adopt(module, prefix=type(module).__name__)
            if self.mode is None:  # on fake tensors the forward writes into fake copies, never the buffers
                self.restore.enter_context(side_effect_free(module))
        return self.module_names[module]

    def enter_module(self, module: nn.Module, _args: Any) -> None:
        self.modules.append(self.module_name(module))

    def exit_module(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if self.modules:
            self.modules.pop()

    def produced(self, func: Any, args: tuple, kwargs: dict, out: Any, frame: FrameType | None) -> None:
        inputs = {self.key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        op = str(func.overloadpacket)
        if op == "ckpt_plugin.checkpoint_name":
            what = f"named {args[1]!r}"
        else:
            what = op if len(outputs) == 1 else None
        writes = is_mutable(func)
        for i, t in enumerate(outputs):
            key = self.key(t)
            # A view keeps its base's producer. An in-place write names the storage
            # after the first writer (relu_ after batch_norm; a dropout mask made by
            # empty_like, bernoulli_, div_ is bernoulli_'s).
            known = self.producers.get(key)
            if key in inputs and known is not None and (not writes or known[3]):
                continue
            name = what or f"{op}[{i}]"
            if self.modules:
                source = f"{self.modules[-1]} {name}"
            else:
                named = name.startswith("named ")
                source = f"{'' if named else 'output of '}{name} in {self._caller(frame)}"
            self.producers[key] = (source, tuple(t.shape), t.dtype, writes)

    def _caller(self, frame: FrameType | None) -> str:
        """The Python function that called an op: the first frame outside torch and this package."""
        while frame is not None:
            if frame.f_code is _RUN_CODE:
                return self.label  # fn is itself a torch op (saved_activations(torch.sin, x))
            path = frame.f_code.co_filename
            if not path.startswith(_TORCH_DIR) and not path.startswith(_PACKAGE_DIR):
                return _readable(getattr(frame.f_code, "co_qualname", frame.f_code.co_name))
            frame = frame.f_back
        return self.label

    def _region(self, frame: FrameType | None) -> str | None:
        """The checkpointed region whose inputs are being saved now, or None."""
        fn = checkpointed_fn(frame)
        if fn is None:
            return None
        while isinstance(fn, functools.partial):
            fn = fn.func
        owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
        if isinstance(owner, nn.Module):
            return self.module_name(owner)
        where = getattr(fn, "__module__", "") or ""
        if where.startswith("ckpt_plugin.") and not where.startswith("ckpt_examples"):
            # Our own regions over several layers (segments) open on their first layer.
            return f"segment from {self.modules[-1]}" if self.modules else None
        return _readable(getattr(fn, "__qualname__", None) or type(fn).__name__)

    # -- the hooks ------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if checkpoint_placeholder(t):  # torch 2.11's 0-byte placeholder, saved with a region's inputs: not a row
            return t
        key = self.key(t)
        if key in self.saved:
            return t
        order = (1, len(self.saved))
        nbytes = t.untyped_storage().nbytes()
        shape, dtype = tuple(t.shape), t.dtype
        if key in self.state:
            source, shape, dtype = self.state[key]
            row = SavedRow(source, shape, dtype, nbytes, is_parameter=True)
        elif key in self.arguments:
            index, name, arg = self.arguments[key]
            order = (0, index)
            row = SavedRow(f"argument {name}", tuple(arg.shape), arg.dtype, nbytes, isinstance(arg, nn.Parameter))
        else:
            region = self._region(inspect.currentframe())
            if key in self.producers:
                source, shape, dtype, _ = self.producers[key]
            else:
                source = f"tensor made outside {self.label}"
            if region is not None:
                source = f"input of checkpointed {region}"
            row = SavedRow(source, shape, dtype, nbytes, is_parameter=isinstance(t, nn.Parameter))
        self.saved[key] = (order, row)
        return t

    def rows(self) -> list[SavedRow]:
        return [row for _order, row in sorted(self.saved.values(), key=lambda e: e[0])]


_RUN_CODE = _Recorder.run.__code__


class _Producers(TorchDispatchMode):
    """Records, for every storage an op creates (or writes in place), the op and where it ran."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Looking up the caller's frame costs a little; only needed outside modules.
        frame = inspect.currentframe() if not self.recorder.modules else None
        self.recorder.produced(func, args, kwargs, out, frame.f_back if frame else None)
        return out


def _bound_tensors(fn: Any, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in the arguments: ``x``, ``params[0]``, ``batch['y']``."""
    try:
        if isinstance(fn, nn.Module):  # the class's forward: a wrapped module's own is (*args, **kwargs)
            named = list(inspect.signature(type(fn).forward).bind(fn, *args, **kwargs).arguments.items())[1:]
        else:
            named = list(inspect.signature(fn).bind(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):  # no signature (a builtin), or it does not bind: fn will say why
        named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    found = []
    for name, value in named:
        for path, leaf in tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                found.append((name + keystr(path), leaf))
    return found


def _root(fn: Any) -> nn.Module | None:
    """The module ``fn`` is, or whose bound method it is (``model.loss``)."""
    owner = getattr(fn, "__self__", None)
    return fn if isinstance(fn, nn.Module) else owner if isinstance(owner, nn.Module) else None


def _label(fn: Any) -> str:
    """What the table calls ``fn``: ``GPT``, ``sin``, ``GPT.loss``, ``f``."""
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    if inspect.isbuiltin(fn):  # torch.sin's qualname is _VariableFunctionsClass.sin
        return fn.__name__
    return _readable(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _readable(qualname: str) -> str:
    """``test_x.<locals>.f`` -> ``f``; ``GPT.loss`` stays."""
    return qualname.rpartition(".<locals>.")[2]


def _short(row: SavedRow) -> str:
    """JAX's spelling: ``f32[5,4]``, ``i64[2,16]``, ``bool[]``."""
    return f"{_DTYPES.get(row.dtype, str(row.dtype).removeprefix('torch.'))}[{','.join(map(str, row.shape))}]"


_DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}

__all__ = ["SavedActivations", "SavedRow", "saved_activations"]

"""Non-reentrant checkpoint calls whose recomputation survives libraries that re-wrap exceptions.

torch's non-reentrant checkpoint ends a recomputation early: once every tensor that backward
needs has been recomputed, its pack hook raises the private ``_StopRecomputationError`` from
inside the recomputed forward, and its unpack hook catches it around the call
(``torch/utils/checkpoint.py``: ``_recomputation_hook`` raises, ``_checkpoint_hook.unpack_hook``
has ``except _StopRecomputationError: pass``; ``set_checkpoint_early_stop`` turns it off).
A library that catches every exception on the way and raises its own turns that into a crash
in backward: einx raises ``CallOperationError`` from it, so x-transformers' ``Attention`` called
with ``mask=`` (its ``einx.where``) fails under any checkpoint, torch's own included
(issue #33). The plugin's calls run ``fn`` through :class:`_Recomputable`, which finds torch's
error in the chain of the one raised (``__cause__`` and ``__context__``, followed to the end)
and raises torch's error again, so torch ends the recomputation as it meant to.

Where a torch release moved the name (checked on 2.11 to 2.15, where it is
``torch.utils.checkpoint._StopRecomputationError``), the calls turn early stop off instead:
recomputation then runs the whole forward, as under ``set_checkpoint_early_stop(False)``.

On torch 2.11 and 2.12 the calls also close the region when ``fn`` raises, as 2.13 does
(:data:`_CLOSES_ON_ERROR`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from typing import Any

import torch
import torch.utils.checkpoint

from ckpt_plugin._compat.region_generator import _region_generator, close_region


def stop_recomputation_error() -> type[BaseException] | None:
    """torch's private ``_StopRecomputationError``, or None where this torch has no such class."""
    found = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)  # private
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def early_stop_in_force(early_stop: bool = True) -> bool:
    """Whether a checkpoint made now with ``early_stop`` stops its recomputation early.

    ``torch.utils.checkpoint.set_checkpoint_early_stop`` overrides every call's own flag while
    it is in force (the private global it sets has no getter)."""
    overridden = getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None)  # private
    return early_stop if overridden is None else bool(overridden)


_GROUPS = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11 on: anyio and trio raise groups


def _chain_has(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``kind`` is ``error`` or among the exceptions it was raised from, or while handling.

    Both links are followed, ``__context__`` even where ``raise ... from None`` hides it from the
    printed traceback, and the members of exception groups."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__, *(e.exceptions if isinstance(e, _GROUPS) else ())]
    return False


def _describe(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', 'forward')}"
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _Recomputable:
    """``fn`` as a checkpoint runs it: torch's early stop passes through whatever wraps it.

    ``forward_first``: the first call is the forward (``torch.utils.checkpoint.checkpoint``
    runs ``fn`` itself first); False for a region opened by hooks, whose ``fn`` only recomputes.
    One object per checkpoint call, so its count of calls is that call's alone.
    """

    __slots__ = ("__wrapped__", "calls", "early_stop", "forward_first", "stop")

    def __init__(self, fn: Any, stop: type[BaseException], forward_first: bool, early_stop: bool) -> None:
        self.__wrapped__ = fn
        self.stop = stop
        self.forward_first = forward_first
        self.early_stop = early_stop  # in force when the checkpoint was made (its frame keeps it)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return self.__wrapped__(*args, **kwargs)
        except Exception as error:
            if type(error) is self.stop:
                raise  # torch's own, unwrapped: the usual path
            if not _chain_has(error, self.stop):
                if self.early_stop and (self.calls > 1 or not self.forward_first):
                    _hint(error, self.__wrapped__)
                raise
        # A fresh error, raised outside the handler: the library's exception, its frames and their
        # tensors are not kept alive by the one torch catches (it carries no state of its own).
        raise self.stop


def _hint(error: BaseException, fn: Any) -> None:
    """Say, on an exception raised while recomputing, what trains a model whose library drops torch's error.

    Only on an error of a library's own: torch's (its determinism check's ``CheckpointError``) and the
    plugin's (its recomputation check) say what they found, and early stop has nothing to do with them."""
    if not hasattr(error, "add_note"):  # Python 3.10: no notes; the error goes as it is
        return
    if type(error).__module__.split(".")[0] in ("torch", "ckpt_plugin"):
        return
    error.add_note(
        f"ckpt_plugin: raised while recomputing {_describe(fn)} for backward (its forward had run). torch's "
        "non-reentrant checkpoint stops a recomputation early by raising _StopRecomputationError inside it "
        "(torch/utils/checkpoint.py); a library that catches it and raises an error of its own without it as "
        "__cause__ or __context__ fails like this. Such a model trains with early stop off: run its forward "
        "under `with torch.utils.checkpoint.set_checkpoint_early_stop(False):`."
    )


def recomputable(fn: Any, forward_first: bool = True, early_stop: bool = True) -> tuple[Any, bool]:
    """``(fn to hand to torch, early_stop to pass)`` for a non-reentrant checkpoint of ``fn``.

    Unchanged while torch.compile traces: the recomputation is then part of the compiled graph,
    and no ``_StopRecomputationError`` is raised. Where this torch has no such class, early stop off.
    """
    if torch.compiler.is_compiling():
        return fn, early_stop
    stop = stop_recomputation_error()
    if stop is None:
        return fn, False
    return _Recomputable(fn, stop, forward_first, early_stop_in_force(early_stop)), early_stop


def non_reentrant_checkpoint(fn: Any, *args: Any, **options: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **options)``, its early
    stop passing through libraries that re-wrap exceptions (the module's docstring), its region
    closed when ``fn`` raises on every torch (:data:`_CLOSES_ON_ERROR`). Every checkpoint call of
    the plugin's engine goes through here (or :func:`open_region`)."""
    fn, early_stop = recomputable(fn, early_stop=options.pop("early_stop", True))
    if not early_stop:  # only then: the keyword as dynamo's checkpoint op sees it stays as it was
        options["early_stop"] = False
    if _CLOSES_ON_ERROR or torch.compiler.is_compiling():  # traced: dynamo's checkpoint op, whatever torch
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **options)
    return _checkpoint_closing_on_error(fn, *args, **options)


# torch 2.11 and 2.12's ``checkpoint`` leave its region open when ``fn`` raises. The region is a generator
# (``_checkpoint_without_reentrant_generator``, private) suspended at its ``yield`` inside checkpoint's
# saved-tensor hooks and ``context_fn``'s forward context (a selective policy's dispatch mode); ``checkpoint``
# resumes it only after ``fn`` returned. On an error those stay in force until the generator is collected,
# and then each pops whatever is on top of torch's stacks by then. When that is, is the interpreter's: on
# Python 3.11 the error's last reference dies with the ``except`` that handles it; from 3.12 on, an error
# converted by a ``contextlib.contextmanager`` (measure/fake.py's NotFakeable) lives in a reference cycle
# (the generator's finished frame keeps its caller, contextlib's ``__exit__``, as ``f_back``:
# cpython#100964, cpython#129280) until a cyclic collection, anywhere later: on 3.12 one came in the middle
# of the no-grad forward that records a forward's value reads, and popped the recording's own mode, so
# nothing was recorded (measure/values.py's UnreplayableRead under ckpt=selective). torch 2.13 throws the
# error into the generator (pytorch#184018); on older torch we run the region as it does.
_CLOSES_ON_ERROR = torch.__version__ >= (2, 13)


def _checkpoint_closing_on_error(fn: Any, *args: Any, preserve_rng_state: bool = True,
                                 context_fn: Any = torch.utils.checkpoint.noop_context_fn,
                                 determinism_check: str = "default", debug: bool = False, early_stop: bool = True,
                                 **kwargs: Any) -> Any:
    """torch 2.13's non-reentrant ``checkpoint(fn, *args, **kwargs)`` on torch 2.11 and 2.12 (same defaults):
    the region's contexts exit when ``fn`` raises, innermost first, and see its error."""
    gen = _region_generator()(fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop,
                              *args, **kwargs)
    next(gen)
    try:
        out = fn(*args, **kwargs)
    except BaseException as error:
        with contextlib.suppress(StopIteration):  # a context that swallowed it: the error goes on all the same
            gen.throw(error)
        raise
    close_region(gen)
    return out


def _unwrapped(fn: Any) -> Any:
    """The function a :class:`_Recomputable` runs (anything else as it is)."""
    return fn.__wrapped__ if isinstance(fn, _Recomputable) else fn

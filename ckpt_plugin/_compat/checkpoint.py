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
"""

from __future__ import annotations

import builtins
import functools
from typing import Any

import torch
import torch.utils.checkpoint


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
    stop passing through libraries that re-wrap exceptions (the module's docstring). Every
    checkpoint call of the plugin's engine goes through here (or :func:`open_region`)."""
    fn, early_stop = recomputable(fn, early_stop=options.pop("early_stop", True))
    if not early_stop:  # only then: the keyword as dynamo's checkpoint op sees it stays as it was
        options["early_stop"] = False
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **options)


def _unwrapped(fn: Any) -> Any:
    """The function a :class:`_Recomputable` runs (anything else as it is)."""
    return fn.__wrapped__ if isinstance(fn, _Recomputable) else fn

"""Non-reentrant checkpoint internals (``torch.utils.checkpoint``, private): a region opened and closed by
hooks around several layers (``engine/segments/chain.py``), the region saving its inputs found on the call stack, and
torch 2.11's placeholder among those inputs."""

from __future__ import annotations

import functools
import inspect
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint

from ckpt_plugin._compat.checkpoint import _unwrapped, recomputable
from ckpt_plugin._compat.region_generator import _region_generator

def open_region(fn: Any, preserve_rng_state: bool, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Start a non-reentrant checkpoint region that later code (not one call) runs inside.

    torch's composable ``checkpoint`` opens its region in a forward pre-hook and
    closes it in a forward hook with this private generator; we do the same
    for regions spanning several layers (``engine/segments/chain.py``). ``fn(*args, **kwargs)``
    is what recomputation runs. Close with :func:`close_region` (or ``gen.close()`` on error).
    """
    generator = _region_generator()
    # ``fn`` only recomputes (the caller runs the forward): torch's early stop must pass through
    # libraries that re-wrap exceptions (``checkpoint.py``), or early stop is off where it cannot.
    fn, early_stop = recomputable(fn, forward_first=False)
    # Positional, not by keyword: the generator's inputs follow as ``*args``, and Python fills
    # named parameters from positional arguments first, so naming them (``fn=fn, ...``) next to
    # any positional input raises "got multiple values". (``args`` cannot go into a closure either:
    # torch saves them as the region's inputs and infers the device and RNG states from them.)
    # ``_region_generator`` checks the names and order instead, so a torch that changes them fails
    # loudly. Same values as torch's composable checkpoint passes.
    gen = generator(
        fn,  # fn
        preserve_rng_state,  # preserve_rng_state
        context_fn,  # context_fn
        "default",  # determinism_check
        False,  # debug
        early_stop,  # early_stop
        *args,
        **kwargs,
    )
    next(gen)
    return gen


def checkpoint_debug_enabled() -> bool:
    """Whether ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` is in force (no getter)."""
    return bool(torch.utils.checkpoint._checkpoint_debug_enabled)


# -- for saved_activations' row sources (residuals.py) --

_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
# torch 2.14 and 2.15 run the region in ``_checkpoint_without_reentrant_generator_impl``, which the
# generator of that name delegates to (``fn`` is a local of both); 2.11 to 2.13 run it in the generator itself.
_REGION_FUNCTIONS = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")


def _region_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the non-reentrant checkpoint region saving its inputs now (see :func:`checkpointed_fn`), or None."""
    for _ in range(10):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in _REGION_FUNCTIONS and code.co_filename == _CHECKPOINT_FILE:
            return frame
        frame = frame.f_back
    return None


def module_running(frame: FrameType) -> Any:
    """The module whose forward ``frame`` runs for torch, or None: ``nn.Module``'s call (``_call_impl``, private:
    its ``self``), or a non-reentrant checkpoint's recomputation (``recompute_fn``, private: the module of its
    ``fn``, which it calls directly). Reads the locals of those two torch frames only: a snapshot of a user's
    frame (``f_locals``, Python 3.11 and 3.12) would keep its rebound tensors alive until it returns."""
    code = frame.f_code
    if code is _CALL_IMPL:
        return frame.f_locals.get("self")
    if code.co_name == "recompute_fn" and code.co_filename == _CHECKPOINT_FILE:
        fn = _unwrapped(frame.f_locals.get("fn"))
        while isinstance(fn, functools.partial) or hasattr(fn, "__wrapped__"):  # functools.wraps' convention
            fn = fn.func if isinstance(fn, functools.partial) else fn.__wrapped__
        return getattr(fn, "__self__", None)
    return None


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def checkpointed_fn(frame: FrameType | None) -> Any:
    """The ``fn`` of the non-reentrant checkpoint that is saving its inputs right now, or None.

    torch saves a region's inputs from inside ``_checkpoint_without_reentrant_generator``
    (or its ``_impl``: ``_REGION_FUNCTIONS``), which is on the call stack only then: while the region runs, the
    generator is suspended at its ``yield``. torch 2.13 and 2.15 save them with ``_CheckpointFrame.save_inputs``,
    2.11 with ``_NoopSaveInputs.apply(dummy, kwargs, *args)`` (a 0-element placeholder first:
    :func:`checkpoint_placeholder`). Private torch internals: if they
    move, those rows fall back to the op that produced the input.
    """
    region = _region_frame(frame)
    return None if region is None else _unwrapped(region.f_locals.get("fn"))  # ours wraps the caller's fn


# torch 2.11: a region saves its inputs as those of an autograd Function, ``_NoopSaveInputs.apply(dummy,
# kwargs, *args)``, with ``dummy = torch.empty((0,), requires_grad=True)`` first among them (so that a region
# without tensor inputs still has a node to hang its hooks on): the saved_tensors_hooks in force pack the
# placeholder too, before the inputs. torch 2.13 and 2.15 save only the inputs (``_CheckpointFrame.save_inputs``)
# and have no ``_NoopSaveInputs``.
_SAVES_PLACEHOLDER = hasattr(torch.utils.checkpoint, "_NoopSaveInputs")


def checkpoint_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t``, being packed by a saved_tensors_hooks' pack now, is the 0-element placeholder a
    torch 2.11 region saves with its inputs (no input of the region, no bytes; always False on 2.13, 2.15).

    Counters of what autograd keeps skip it, so that they count the same on every release."""
    if not _SAVES_PLACEHOLDER or t.numel() != 0 or not t.requires_grad or t.grad_fn is not None:
        return False  # cheap checks first: packs run for every saved tensor
    region = _region_frame(inspect.currentframe())
    return region is not None and region.f_locals.get("dummy") is t

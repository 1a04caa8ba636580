"""A recurrence whose backward keeps a few carries, not one per step.

Two forms. The PyTorch counterpart of Theano's ``scan_checkpoints``: run
``carry = fn(carry, *non_sequences)`` for ``n_steps`` steps, return every
carry, keep for backward only the carry that enters each window of
``save_every_n`` steps, and recompute the steps inside a window when backward
reaches it::

    import torch
    from ckpt_plugin.engine.scan.scan import checkpoint_scan

    W = torch.randn(16, 16, requires_grad=True)
    b = torch.zeros(16, requires_grad=True)
    h0 = torch.zeros(4, 16)

    def cell(h, W, b):
        return torch.tanh(h @ W + b)

    hs = checkpoint_scan(cell, h0, 1024, save_every_n=32, non_sequences=(W, b))
    hs.shape             # (1024, 4, 16): every step's carry, hs[-1] is the last
    hs[-1].sum().backward()  # W.grad and b.grad as from a plain Python loop

And the last carry only (an RNN's final state, an ODE solve, a simulator),
with Griewank's binomial checkpointing ("revolve", :mod:`.revolve`): at most
``snapshots`` carries kept at any time, ``init`` included, and the fewest
recomputed steps any schedule keeping that many can have::

    h = checkpoint_scan(cell, h0, 1024, snapshots=8, outputs="last", non_sequences=(W, b))
    h.shape              # (4, 16): the carry after step 1024
    h.sum().backward()   # the plain loop's gradients, bit for bit

What is alive with ``save_every_n``, in carries (one carry = ``init``'s bytes):

* kept for backward: the input carry of every window, ``ceil(n_steps /
  save_every_n)`` of them (the first is ``init`` itself), and whatever ``fn``
  closes over; nothing of the steps inside a window, where a plain loop keeps
  each step's saved tensors (at least one carry per step);
* the returned stack, ``n_steps`` carries. That is an *output*, not an
  activation saved for backward: returning every step costs it, as it does in
  Theano's ``scan``. It is allocated once up front and each window's stack is
  copied in and freed, so the forward never holds it twice;
* while one window runs, in the forward or recomputed in backward: that
  window's ``save_every_n`` steps (in the forward, their outputs and their
  stack, 2 * save_every_n carries).

For the example above (1024 steps of a (4, 16) float32 carry, 256 bytes) the
tests measure 32 carries saved for backward against 1025 for the plain loop,
and an activation peak of 1024 + 31 + 64 carries against 2048. Kept for
backward plus the window being recomputed is ``n_steps / save_every_n +
save_every_n`` carries, least near ``save_every_n = sqrt(n_steps)``; the price
is one extra forward of every step (each window is recomputed exactly once).

Unlike Theano, which pads and then requires ``save_every_n`` to divide the
number of steps, the last window is simply shorter when it does not; and a
``save_every_n`` of ``n_steps`` or more is one window (the whole loop is
checkpointed as a single piece), as Theano's ``ceil(n_steps / save_every_N)``
outer steps also make it.

What is alive with ``snapshots=k, outputs="last"``, in carries:

* between forward and backward: ``init`` and the ``min(k, n_steps) - 1``
  snapshots the forward took, each with the RNG state it was taken at when
  ``preserve_rng_state`` (5 KB on CPU, which MemTracker does not see); and the
  returned carry, an output. Nothing of any step;
* while a step runs without grad (the forward, or a re-advance in backward):
  the snapshots, the carry it starts from and ``fn``'s own temporaries;
* while backward reverses a step: the snapshots (never more than ``k``,
  ``init`` included), the carry re-advanced to, that step run once with grad
  (what it saves, its output and its gradients), the gradient coming into it
  and the running sums of the non-sequences' gradients (one copy of them).

Calls of ``fn``: ``n_steps`` with grad, one per step just before its
backward, and ``T(n_steps + 1, k)`` without, the forward's ``n_steps``
included, where ``T(l, s) = t*l - C(s+t, t-1)`` with ``C(s+t-1, s) < l <=
C(s+t, s)`` is Griewank's minimum (:mod:`.revolve` explains the ``+ 1``):
``k = 1`` re-advances every step from ``init`` (``n(n+1)/2`` calls without
grad), ``k >= n_steps`` keeps every carry and re-advances nothing.

For the example above (1024 steps, ``k = 8``, a (4, 16) float32 carry of 256
bytes) ``fn`` runs 4410 times without grad (4.3 per step) and 1024 times
with grad, where the window scan with ``save_every_n=32`` runs 2048 times;
MemTracker measures an activation peak of 10 carries (7 snapshots, the carry
a step starts from, ``h @ W`` and ``+ b``) against 1025 for the plain loop,
and a training step that peaks at exactly one step of the plain loop plus 9
carries plus one copy of ``W``'s and ``b``'s gradients, whatever the number
of steps (``tests/test_revolve.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from ckpt_plugin._compat import non_reentrant_checkpoint
from ckpt_plugin.engine.scan.scan_reversal import last_carry

__all__ = ["checkpoint_scan"]

OUTPUTS = ("all", "last")  # every carry stacked (windows), or the last one (the binomial schedule)


def _is_int(x: Any) -> bool:
    # bool is an int subclass; ``save_every_n=True`` is a typo, not a window size.
    return isinstance(x, int) and not isinstance(x, bool)


# Each ``outputs`` takes one schedule argument and refuses the other: (takes, refuses).
_SCHEDULE_OF = {"all": ("save_every_n", "snapshots"), "last": ("snapshots", "save_every_n")}
# What each schedule argument is, said when it is given to the other ``outputs``, missing, or not an int >= 1.
_FOR_THE_OTHER = {
    "snapshots": "is for outputs='last' (the last carry only, Griewank's binomial schedule); with outputs='all' "
                 "every carry is returned and save_every_n sets the windows",
    "save_every_n": "is for outputs='all' (windows of the stacked carries); with outputs='last' snapshots=k alone "
                    "sets the schedule",
}
_NEEDED = {
    "save_every_n": "is needed with outputs='all' (the default): an int >= 1, the number of steps per checkpointed "
                    "window; or pass outputs='last' and snapshots=k for the last carry only",
    "snapshots": "is needed with outputs='last': an int >= 1, the most carries kept at once, init included",
}
_MEANING = {
    "save_every_n": "must be an int >= 1: the number of steps per checkpointed window (1 keeps every carry, n_steps "
                    "or more checkpoints the whole loop as one window, about sqrt(n_steps) keeps the least)",
    "snapshots": "must be an int >= 1: the most carries kept at once, init included (1 recomputes every step from "
                 "init, n_steps or more keeps every carry)",
}


def _schedule_problems(outputs: str, given: dict[str, Any]) -> list[str]:
    """The problems with ``save_every_n`` and ``snapshots`` (``given``) for ``outputs`` ('all' or 'last')."""
    takes, refuses = _SCHEDULE_OF[outputs]
    problems = []
    if given[refuses] is not None:
        problems.append(f"{refuses}={given[refuses]!r} {_FOR_THE_OTHER[refuses]}")
    value = given[takes]
    if value is None:
        problems.append(f"{takes} {_NEEDED[takes]}")
    elif not _is_int(value) or value < 1:
        problems.append(f"{takes}={value!r} {_MEANING[takes]}")
    return problems


def _check_arguments(
    fn: Any,
    init: Any,
    n_steps: Any,
    save_every_n: Any,
    snapshots: Any,
    outputs: Any,
    non_sequences: Any,
    preserve_rng_state: Any,
) -> None:
    """Collect every problem with the arguments and raise them together.

    ``outputs="all"`` takes ``save_every_n`` and no ``snapshots``;
    ``outputs="last"`` takes ``snapshots`` and no ``save_every_n`` (the
    binomial schedule places its own checkpoints: windows would only be a
    worse schedule).
    """
    problems = []
    if not callable(fn):
        problems.append(
            f"fn={fn!r} ({type(fn).__name__}) must be callable as fn(carry, *non_sequences) -> next carry"
        )
    if not isinstance(init, torch.Tensor):
        problems.append(
            f"init={init!r} ({type(init).__name__}) must be a torch.Tensor, the first carry; "
            "wrap a number with torch.tensor(...)"
        )
    if not _is_int(n_steps) or n_steps < 1:
        problems.append(f"n_steps={n_steps!r} must be an int >= 1, the number of times fn is applied")
    if not isinstance(outputs, str) or outputs not in OUTPUTS:
        problems.append(
            f"outputs={outputs!r} must be 'all' (every carry stacked, with save_every_n) "
            "or 'last' (the last carry only, with snapshots)"
        )
    else:
        problems += _schedule_problems(outputs, {"save_every_n": save_every_n, "snapshots": snapshots})
    if not isinstance(non_sequences, (tuple, list)):
        hint = ""
        if isinstance(non_sequences, torch.Tensor):
            hint = " (a single tensor goes in a tuple: non_sequences=(W,))"
        problems.append(
            f"non_sequences must be a tuple or list of the extra arguments of fn, "
            f"got {type(non_sequences).__name__}{hint}"
        )
    if not isinstance(preserve_rng_state, bool):
        problems.append(f"preserve_rng_state={preserve_rng_state!r} must be True or False")
    if problems:
        raise ValueError("checkpoint_scan: " + "; ".join(problems))


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _step(
    fn: Callable[..., torch.Tensor], carry: torch.Tensor, non_sequences: tuple[Any, ...], i: int
) -> torch.Tensor:
    """One application of ``fn``, checked: a carry that changes shape, dtype or device cannot be stacked."""
    out = fn(carry, *non_sequences)
    if (
        isinstance(out, torch.Tensor)
        and out.shape == carry.shape
        and out.dtype == carry.dtype
        and out.device == carry.device
    ):
        return out
    got = _describe(out) if isinstance(out, torch.Tensor) else type(out).__name__
    raise ValueError(
        f"checkpoint_scan: fn must return the next carry, a tensor like init ({_describe(carry)}); "
        f"at step {i} it returned {got}"
    )


def _window(
    fn: Callable[..., torch.Tensor], first: int, length: int, carry: torch.Tensor, *non_sequences: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``length`` steps from ``carry``: their outputs stacked (length, *carry.shape), and the last carry.

    The last carry is returned as its own tensor, not as a view of the stack:
    the next window's checkpoint holds it as its input until backward, and a
    view would keep this window's whole stack alive with it.
    """
    outs = []
    for i in range(first, first + length):
        carry = _step(fn, carry, non_sequences, i)
        outs.append(carry)
    return torch.stack(outs), carry


class _WriteSlice(torch.autograd.Function):
    """``out[first:first + len(window)] = window`` in place, with a backward that copies nothing.

    Each window's stack is written into the result as soon as it exists and
    then freed, so the forward never holds all the windows and their
    concatenation at once (``torch.cat`` at the end would: 2 * n_steps
    carries). Autograd's own slice assignment (``CopySlices``) would do the
    same in the forward, but its backward clones the whole incoming gradient
    once per window to zero the written slice. The windows are disjoint, so
    the earlier writes read only their own slices, never the overwritten
    ones: the gradient passes down the chain unchanged and each window gets a
    view of its slice.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, window: torch.Tensor, first: int) -> torch.Tensor:
        ctx.window_slice = slice(first, first + window.shape[0])
        out[ctx.window_slice] = window
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        grad_out = grad if ctx.needs_input_grad[0] else None
        grad_window = grad[ctx.window_slice] if ctx.needs_input_grad[1] else None
        return grad_out, grad_window, None


def checkpoint_scan(
    fn: Callable[..., torch.Tensor],
    init: torch.Tensor,
    n_steps: int,
    *,
    save_every_n: int | None = None,
    snapshots: int | None = None,
    outputs: Literal["all", "last"] = "all",
    non_sequences: tuple[Any, ...] | list[Any] = (),
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """Apply ``carry = fn(carry, *non_sequences)`` ``n_steps`` times; return every carry stacked, or the last.

    With ``outputs="all"`` (the default) and ``save_every_n``: returns a
    tensor of shape ``(n_steps, *init.shape)`` whose ``[t]`` is the carry
    after step ``t + 1`` (``[-1]`` is the last one). The steps run in windows
    of ``save_every_n`` (the last window is shorter when it does not divide
    ``n_steps``), each under non-reentrant
    ``torch.utils.checkpoint.checkpoint``: backward keeps only each window's
    input carry and recomputes the window's steps when it needs them.

    With ``outputs="last"`` and ``snapshots=k``: returns the carry after the
    last step, shaped like ``init``. The forward runs every step without grad
    and keeps the carries Griewank's binomial schedule asks for
    (:func:`.revolve.schedule`); backward reverses the steps from the last,
    each restored from the nearest snapshot, re-advanced without grad, run
    once with grad and backpropagated. At most ``k`` carries are kept at any
    time, ``init`` included, and ``fn`` is called ``n_steps + T(n_steps + 1,
    k)`` times, the fewest any such schedule can do; ``save_every_n`` has no
    place there (nor ``snapshots`` with ``outputs="all"``).

    Either way the result equals a plain Python loop bit for bit, and so do
    the gradients for ``init``, for the tensors in ``non_sequences`` (weights:
    they are inputs of each window, or of the reversal's node) and for the
    tensors ``fn`` closes over (a module's parameters). See the module
    docstring for exactly what stays alive.

    ``preserve_rng_state`` replays the RNG state of each window, or of each
    snapshot, during its recomputation, so random ops in ``fn`` (dropout) draw
    the same numbers and the gradients match the plain loop; turn it off only
    for an ``fn`` without randomness, to save the state snapshots.
    """
    _check_arguments(fn, init, n_steps, save_every_n, snapshots, outputs, non_sequences, preserve_rng_state)
    non_sequences = tuple(non_sequences)
    if outputs == "last":
        return last_carry(fn, _step, init, n_steps, snapshots, non_sequences, preserve_rng_state)

    out = init.new_empty((n_steps, *init.shape))  # (n_steps, *init.shape)
    if not torch.is_grad_enabled():
        # Nothing will be recomputed, so checkpointing would only add the cost of
        # snapshotting RNG states: run the loop itself, writing into the result.
        carry = init
        for i in range(n_steps):
            carry = _step(fn, carry, non_sequences, i)
            out[i] = carry
        return out

    carry = init
    for first in range(0, n_steps, save_every_n):
        length = min(save_every_n, n_steps - first)
        stacked, carry = non_reentrant_checkpoint(  # stacked: (length, *init.shape)
            _window,
            fn,
            first,
            length,
            carry,
            *non_sequences,
            # Non-reentrant: works with torch.autograd.grad, with an init that
            # needs no gradient, and gives gradients to tensors fn closes over.
            preserve_rng_state=preserve_rng_state,
        )
        out = _WriteSlice.apply(out, stacked, first)
        del stacked  # or it stays alive while the next window runs
    return out

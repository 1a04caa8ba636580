"""A wrapped module must compute the same thing when backward recomputes it.

Checkpointing runs a module's forward twice, once in the forward pass and once
in backward, and the gradient is only right if both runs save the same
tensors. torch checks the shape, dtype and device of every tensor the
recomputation saves against the forward's (``determinism_check="default"``),
but in its unpack hook, deep inside backward, so its ``CheckpointError`` says
neither which module nor which tensor ("Recomputed values for the following
tensors have different metadata ...").

By default that check of torch's is all there is: a wrapped call is plain
``checkpoint(fn, *args, use_reentrant=False)`` and nothing of ours runs per
saved tensor (issue #12: the per-tensor check below cost most of the plugin's
overhead over a hand-written checkpoint). torch raises its error after the
recomputation has returned, outside anything a wrapped call runs, so there is
no cheap place to add the module's name to it; the opt-in below names it.

Inside :func:`checking_recomputation` (or with ``ckpt.check_recompute=true``)
each wrapped call pushes saved-tensor hooks (under checkpoint's own, to which
they hand every tensor on) that record the shape, dtype and device of what the
forward saves and compare the recomputation with it tensor by tensor as it
goes. A mismatch raises :class:`RecomputationMismatch` (a ``CheckpointError``)
naming the module's qualified name and class, the tensor and both shapes,
before torch's own check could run. A recomputation that saves fewer or more
tensors is reported the same way.

Values are not checked, as in torch: a recomputation that draws other random
numbers (``preserve_rng_state=false`` with dropout), reads a flag flipped
between forward and backward, or runs a nondeterministic kernel gives a
different gradient with no error. Run the forward inside
:func:`checking_recomputed_values` to compare values too, exactly (NaN equal
to NaN), and the metadata with them: every wrapped call then keeps a copy of
each tensor it saves for as long as its graph lives, more memory than no
checkpointing at all. Both are debugging tools, like
``torch.autograd.detect_anomaly``. BatchNorm's running statistics, which
batch_norm saves, the recomputation updates and ``norms.py`` then restores,
are not compared (backward in training mode does not read them).

Under ``torch.compile`` nothing here runs: the partitioner recomputes from the
one traced graph, so there is no second Python run that could differ
(``treatment.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointError

from ckpt_plugin._compat import outer_saved_tensors_hooks, storage_key

__all__ = ["RecomputationMismatch", "checking_recomputation", "checking_recomputed_values", "recomputation_checked"]

# Scoped like grad mode: set on entry, reset by token on exit, per thread and per async
# context. They are read when a wrapped call's forward starts, so they must span the forward.
_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_plugin_check_recompute", default=False)
_CHECK_VALUES: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_plugin_check_values", default=False)

_ADVICE = (
    "Checkpointing runs a module's forward again in backward and needs the same computation both "
    "times: its forward must depend only on its inputs, parameters and buffers, not on a counter, "
    "a flag or a global changed in between (nor on random numbers, unless ckpt.preserve_rng_state=true). "
    "Make the forward deterministic, or leave the module out of ckpt.layers."
)


class RecomputationMismatch(CheckpointError):
    """The recomputation of a wrapped module saved something other than its forward did."""


@contextlib.contextmanager
def checking_recomputation() -> Iterator[None]:
    """Check, naming the module, that every wrapped module's recomputation saves what its forward saved.

    >>> with checking_recomputation():
    ...     loss = model.loss(batch)
    >>> loss.backward()     # RecomputationMismatch naming the module if a shape, dtype or device differs

    What torch checks anyway, but with the module's name in the error; it costs
    a Python hook per saved tensor (``ckpt.check_recompute=true`` does the same
    for every step). Values are not compared: :func:`checking_recomputed_values`.
    """
    token = _CHECK.set(True)
    try:
        yield
    finally:
        _CHECK.reset(token)


@contextlib.contextmanager
def checking_recomputed_values() -> Iterator[None]:
    """Compare the values every wrapped module saves too, exactly, for the forward run inside.

    >>> with checking_recomputed_values():
    ...     loss = model.loss(batch)
    >>> loss.backward()     # RecomputationMismatch if a recomputation saved other values

    Implies :func:`checking_recomputation`. Each wrapped call keeps a copy of
    every tensor it saves for as long as its graph lives: more memory than no
    checkpointing. For debugging only.
    """
    token = _CHECK_VALUES.set(True)
    try:
        yield
    finally:
        _CHECK_VALUES.reset(token)


def recomputation_checked() -> bool:
    """Whether a wrapped call starting now is checked (inside either context manager above).

    Never while dynamo traces: compiled, there is no second run to check, and dynamo
    cannot trace ``ContextVar.get`` (it would break the graph at every wrapped call).
    """
    return not torch.compiler.is_compiling() and (_CHECK.get() or _CHECK_VALUES.get())


def _meta(t: torch.Tensor) -> tuple:
    """What torch's default determinism check compares: shape, dtype, device."""
    return t.shape, t.dtype, t.device


def _describe(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(str(s) for s in shape)}] on {device}"


def _source(t: torch.Tensor) -> Any:
    """What made a saved tensor (its grad_fn's type), or whether it is a parameter; formatted on error."""
    return type(t.grad_fn) if t.grad_fn is not None else isinstance(t, torch.nn.Parameter)


def _describe_source(source: Any) -> str:
    if source is True:
        return "a parameter"
    if source is False:
        return "a tensor without autograd history"
    return f"output of {re.sub(r'Backward[0-9]*$', '', source.__name__)}"


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly equal, NaN equal to NaN (a NaN computed twice is no mismatch)."""
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


class CallRecord:
    """What one checkpointed call saved in its forward; checks its recomputations against it.

    ``label`` names the module in errors (``"blocks.1 (TransformerBlock)"``).
    ``forward()`` and ``recompute()`` are the context managers given to
    ``checkpoint``'s ``context_fn``; ``recompute()`` may run more than once
    (a second backward with ``retain_graph=True``), each run checked afresh.
    """

    def __init__(self, label: str, stats: list[tuple[torch.nn.Module, str]] = ()) -> None:
        self.label = label
        self.saved: list[tuple] = []  # (shape, dtype, device) of each saved tensor, in save order
        self.sources: list[Any] = []  # what made each, for the message
        self.copies: list[torch.Tensor | None] | None = [] if _CHECK_VALUES.get() else None
        # Running statistics (norms.py) are saved by batch_norm, written again by the recomputation
        # and restored after it; backward does not read them in training mode. Not compared.
        self.state = {storage_key(getattr(m, name)) for m, name in stats} if self.copies is not None else set()
        self.complete = False  # the forward has finished saving

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        outer_pack, outer_unpack = self._outer()

        def pack(t: torch.Tensor) -> object:
            self.saved.append(_meta(t))
            self.sources.append(_source(t))
            if self.copies is not None:
                with torch.no_grad():
                    self.copies.append(None if storage_key(t) in self.state else t.detach().clone())
            return outer_pack(t)

        with saved_tensors_hooks(pack, outer_unpack):
            yield
        self.complete = True

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        outer_pack, outer_unpack = self._outer()
        count = 0

        def pack(t: torch.Tensor) -> object:
            nonlocal count
            count += 1
            if self.complete:
                self._check(count, t)
            return outer_pack(t)

        # When the recomputation has saved as many tensors as the forward, checkpoint stops
        # it by raising through here (early stop); a normal exit with fewer saved is a mismatch.
        with saved_tensors_hooks(pack, outer_unpack):
            yield
        if self.complete and count < len(self.saved):
            raise self._error(
                f"its forward saved {len(self.saved)} tensors for backward and its recomputation only {count}"
            )

    def _check(self, n: int, t: torch.Tensor) -> None:
        total = len(self.saved)
        if n > total:
            raise self._error(f"its recomputation saved more tensors for backward than the {total} its forward saved")
        before, now = self.saved[n - 1], _meta(t)
        if before != now:
            raise self._error(
                f"tensor {n} of the {total} it saved for backward ({self._source(n)}) was "
                f"{_describe(before)} in the forward and {_describe(now)} in the recomputation"
            )
        copy = self.copies[n - 1] if self.copies is not None else None
        if copy is not None:
            with torch.no_grad():
                if not _equal(copy, t):
                    differ = int((~torch.isclose(copy, t, rtol=0.0, atol=0.0, equal_nan=True)).sum())
                    raise self._error(
                        f"tensor {n} of the {total} it saved for backward ({self._source(n)}, {_describe(now)}) "
                        f"has other values in the recomputation: {differ} of {t.numel()} elements differ"
                    )

    def _source(self, n: int) -> str:
        return _describe_source(self.sources[n - 1])

    def _error(self, what: str) -> RecomputationMismatch:
        return RecomputationMismatch(
            f"{self.label} computed something else when recomputed for backward: {what}. {_ADVICE}"
        )

    def _outer(self) -> tuple:
        # Entered by checkpoint inside its own saved-tensor hooks: those are the innermost.
        hooks = outer_saved_tensors_hooks()
        assert hooks is not None, "CallRecord's contexts run inside torch.utils.checkpoint"
        return hooks

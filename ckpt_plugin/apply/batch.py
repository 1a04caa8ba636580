"""``ckpt.batch=max``: the largest micro-batch whose whole step fits ``ckpt.memory``, found by planning, not by
crashing.

Lightning's ``BatchSizeFinder`` and Accelerate's ``find_executable_batch_size`` run
real steps, doubling the batch until one fails with out-of-memory, with
checkpointing held fixed. Here the batch is searched on fake tensors: for a batch
size ``b``, the sample call is made ``b`` rows long (each tensor whose first
dimension is the sample's batch, expanded from its first row: a view, no memory),
``ckpt=auto``'s least plan for it (``ckpt.budget=min``: every strategy) is planned
and its whole step measured (``measure/whole_step.py``); that peak grows with the
batch, so doubling from the sample's batch, then bisection, finds the largest
``b`` whose least whole step fits: exactly, not on a grid. ``apply/auto.py`` then
plans the fastest plan at that batch, timing the options on the sample's own batch
(never a real step at the larger one).

Nothing here runs the model on real tensors at more than the sample's size, except
a forward that reads values (``measure/values.py``), recorded at each size tried
without autograd.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import active_fake_mode, tree_leaves, tree_map
from ckpt_plugin.apply.memory import ModuleSteps, WholeSteps, too_small
from ckpt_plugin.apply.strategies import Measuring, least_of, strategies
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.whole_step import Held, StepSplit
from ckpt_plugin.units import format_bytes

MOST = 2**16  # a batch search stops here where nothing bounds it (a dataset of unknown length)


def batch_size_of(data: Any) -> int | None:
    """The batch of a call or a batch: the first dimension of its first tensor of at least one dimension; or None."""
    for t in tree_leaves(data):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    return None


def resized(data: Any, size: int, to: int) -> Any:
    """``data`` (a call's arguments, a batch) with every tensor whose first dimension is ``size`` made ``to`` rows
    long: its first row, expanded (a view: no memory). :func:`materialized` makes them whole inside the step."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == size and size != to:
            return t[:1].expand(to, *t.shape[1:])
        return t

    return tree_map(one, data)


def materialized(data: Any) -> Any:
    """Each expanded tensor of :func:`resized` made contiguous: model code may ``view`` it, as a real batch allows."""
    return tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 1
                    and t.stride(0) == 0 else t, data)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _held(data: Any) -> Callable[[], Any]:
    """``data`` materialized once (per fake mode) and held, as a real batch is: made before the step a
    measurement tracks (the first of ``whole_step``'s two, or the profile's first call) and alive to its end, as
    the loader's batch is made before ``training_step`` and lives through it. So MemTracker never counts it, on
    fake or real tensors; :meth:`Sample.held` says what it takes."""
    held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    real: list[Any] = []

    def get() -> Any:
        mode = active_fake_mode()
        if mode is None:
            if not real:
                real.append(materialized(data))
            return real[0]
        if mode not in held:
            held[mode] = materialized(data)
        return held[mode]

    return get


@dataclass(frozen=True)
class Sample:
    """What the batch search resizes: the module's call and, where the caller has them, the training batch and
    the step that takes it to a loss (the callback: ``training_step``, logging silenced, effects contained).
    ``call`` is None where ``training_step`` runs the model otherwise than through ``self(...)`` (a child, a loss
    module): the step alone is then what is measured and resized."""

    call: tuple[tuple, dict] | None
    run: Callable[..., Any]  # run(*args, **kwargs): the module's call (under the precision's context)
    batch: Any = None
    step: Callable[[Any], Any] | None = None  # batch -> the loss

    def __post_init__(self) -> None:
        assert self.call is not None or (self.step is not None and self.batch is not None), "a call or a step"

    @property
    def size(self) -> int | None:
        return batch_size_of(self.call) if self.call is not None else batch_size_of(self.batch)

    def held(self, to: int | None = None) -> Held:
        """The batch on the device, ``to`` rows long (None: as it is): the training batch, or the call's tensors."""
        data = self.batch if self.step is not None and self.batch is not None else self.call
        size = batch_size_of(data)
        rows = 1 if to is None or not size else to / size
        return Held(int(sum(_bytes(t) * (rows if t.dim() > 0 and t.shape[0] == size else 1)
                            for t in tree_leaves(data) if isinstance(t, torch.Tensor))), "the batch")

    def forward(self, to: int | None = None) -> Callable[[], Any]:
        """The module's call, its batch ``to`` rows long (None: as it is); the step where there is no call."""
        if self.call is None:
            return self.loss(to)
        return self._called(to)[0]

    def _called(self, to: int | None) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """The module's call at ``to`` rows, and what gives its arguments."""
        if to is None or to == self.size:
            call: Callable[[], Any] = lambda: self.call  # noqa: E731
        else:
            call = _held(resized(self.call, self.size, to))

        def forward() -> Any:
            args, kwargs = call()
            return self.run(*args, **kwargs)

        return forward, call

    def cast(self, dtype: torch.dtype) -> Sample:
        """This sample with its floating-point tensors in ``dtype``, as a strategy's precision converts the batch
        before the step (Lightning's ``convert_input``: DeepSpeed's bf16 and fp16)."""
        def to(t: Any) -> Any:
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return replace(self, call=tree_map(to, self.call), batch=tree_map(to, self.batch))

    def loss(self, to: int | None = None) -> Callable[[], Any]:
        """The training step to its loss at ``to`` rows (the whole step measures it); the call where there is none."""
        return self.loss_and_batch(to)[0]

    def loss_and_batch(self, to: int | None = None) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """:meth:`loss`, and what gives the batch that step runs on (real tensors: the ones it reads)."""
        if self.step is None or self.batch is None:
            return self._called(to)
        size = batch_size_of(self.batch)
        if to is None or size is None or to == size:
            return (lambda: self.step(self.batch)), (lambda: self.batch)
        batch = _held(resized(self.batch, size, to))
        return (lambda: self.step(batch())), batch


@dataclass(frozen=True)
class BatchFit:
    """What ``ckpt.batch=max`` found: the batch, the least plan's whole step there and one row more."""

    batch: int
    sample_batch: int
    least: StepSplit  # the least plan's whole step at ``batch``
    above: StepSplit | None  # at ``batch + 1`` (None: the search stopped at its bound)
    tried: dict[int, int]  # batch size -> the least plan's whole-step peak, in the order tried
    bound: int

    def lines(self, limit: int) -> list[str]:
        above = (f"; at {self.batch + 1} it would peak at {format_bytes(self.above.peak)}" if self.above is not None
                 else f"; the search stops at {self.bound}")
        return [f"ckpt.batch=max: {self.batch} samples per micro-batch (the sample had {self.sample_batch}), the "
                f"largest whose whole step fits {format_bytes(limit)} with the least peak any plan reaches "
                f"({format_bytes(self.least.peak)}){above}; {len(self.tried)} batch sizes planned on fake tensors"]


def largest_fitting(peak: Callable[[int], int], start: int, bound: int, limit: int) -> int:
    """The largest ``b`` in [1, ``bound``] with ``peak(b) <= limit`` (0 if none), for ``peak`` growing with ``b``:
    exact (``peak(b + 1) > limit`` was measured, unless ``b`` is ``bound``), in few calls of ``peak``.

    A plan's whole step is affine in the batch (parameters and state fixed, activations per sample), so each
    guess is the line through the two nearest measured sizes, checked with the size after it; where the least
    plan changes with the batch and the line misses, the guesses still narrow the bracket, as bisection would.
    """
    seen: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in seen:
            seen[b] = peak(b)
        return seen[b] <= limit

    low, high = 0, bound + 1  # fits at low (0: nothing yet), not at high (bound + 1: nothing yet)
    probe = min(max(start, 1), bound)
    while high - low > 1:
        if fits(probe):
            low = probe
        else:
            high = probe
        if high - low <= 1:
            break
        probe = _next_probe(seen, low, high, limit)
    return low


def _next_probe(seen: dict[int, int], low: int, high: int, limit: int) -> int:
    """The next batch size to measure inside (low, high): on the line through the two nearest measured sizes,
    the last that fits by it, or the one after it where that one was measured; by halving or doubling without a line."""
    points = sorted(seen)
    if len(points) < 2:  # one size measured: double it (or halve it)
        return min(low * 2, high - 1) if low else max(high // 2, 1)
    near = sorted(points, key=lambda b: abs(seen[b] - limit))[:2]
    (b0, p0), (b1, p1) = sorted((b, seen[b]) for b in near)
    if p1 <= p0:  # no growth seen between them: bisect
        return (low + high) // 2 if high <= 2 * max(low, 1) else min(low * 2, high - 1)
    guess = b0 + (limit - p0) * (b1 - b0) // (p1 - p0)
    if guess in seen and guess + 1 not in seen:
        guess += 1
    if not low < guess < high or guess in seen:
        return (low + high) // 2 if high <= 2 * max(low, 1) else min(low * 2, high - 1)
    return guess


def largest_batch(model: nn.Module, names: list[str], sample: Sample, limit: int,
                  optimizers: Sequence[torch.optim.Optimizer], *, bound: int = MOST, preserve_rng_state: bool = True,
                  key: str = "ckpt.memory", held: Sequence[Held] = (), steps: WholeSteps | None = None,
                  chains: bool = True) -> BatchFit:
    """The largest batch (at most ``bound``) whose least plan's whole step fits ``limit`` bytes.

    A ConfigError where not even one sample fits, naming the least memory needed and what takes it. The least
    plan is found on ``model`` at each size; its whole step is measured by ``steps`` (default: on ``model``, the
    sample's step, ``optimizers`` stepping, ``held`` and the batch beside it).
    """
    steps = steps or ModuleSteps(model, sample.loss, optimizers, lambda rows: (*held, sample.held(rows)))
    size = sample.size
    if size is None:
        raise ConfigError([Problem("ckpt.batch", "ckpt.batch=max resizes the sample's batch, and the sample call "
                                   "has no tensor with a batch dimension", "set ckpt.batch=null")])
    tried: dict[int, StepSplit] = {}

    def least(batch: int) -> StepSplit:
        if batch not in tried:
            measuring = Measuring(model, names, sample.loss(batch), {}, preserve_rng_state, timed=False,
                                  chains=chains)
            chosen = least_of(strategies(measuring, eager=True))
            tried[batch] = steps.of(chosen.strategy.installed(chosen.plan), batch)
        return tried[batch]

    low = largest_fitting(lambda batch: least(batch).peak, size, bound, limit)
    if not low:
        raise ConfigError([too_small(limit, tried[1], None, key, at="at a batch of one sample")])
    above = tried.get(low + 1)
    return BatchFit(low, size, tried[low], above, {b: s.peak for b, s in tried.items()}, bound)


__all__ = ["MOST", "BatchFit", "Sample", "batch_size_of", "largest_batch", "largest_fitting", "materialized", "resized"]

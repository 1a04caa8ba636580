"""``ckpt.memory`` and ``ckpt.batch=max`` under Lightning: the whole step the plan is made for, the batch it is
made at, and the whole step measured at the second batch.

The whole step measured while planning (``measure/whole_step.py``) runs the
module's own ``training_step`` on the first training batch (its loss included:
a large vocabulary's logits and their cross-entropy are part of the step),
``self.log`` silenced, under the precision plugin's context, and steps the
Trainer's optimizers. Where there is no batch, or the module optimizes manually
(its ``training_step`` steps the optimizers itself), it runs the module's call
on the sample and sums the output, as ``ckpt=auto``'s profile does, and says so.

``ckpt.batch=max``: the batch is searched on fake tensors (``apply/batch.py``),
then set as Lightning's ``BatchSizeFinder`` sets it.

The size is written where ``BatchSizeFinder`` writes it (``lightning_setattr``: a
``batch_size`` attribute of the LightningModule, of its ``hparams``, or of the
datamodule, every one that has it), and the train dataloader is built again from
it. Both run in ``on_fit_start``, where ``BatchSizeFinder`` runs too, before the
first batch is drawn. The bound of the search is the train dataset's length, as
``BatchSizeFinder`` stops there too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from ckpt_plugin._compat import CategoryPeakTracker, seen_bytes, tree_leaves
from ckpt_plugin.apply.batch import MOST, Sample, largest_batch
from ckpt_plugin.apply.memory import WholeSteps
from ckpt_plugin.apply.plan import candidates, plan_for
from ckpt_plugin.apply.twin import Twin, TwinSteps, twin_sample
from ckpt_plugin.config.memory import resolve_memory
from ckpt_plugin.config.schema import AutoConfig
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.lightning.sample import (
    first_batch,
    random_state_kept,
    sample_call,
    train_dataloader,
)
from ckpt_plugin.lightning.step import STEP, step_loss
from ckpt_plugin.lightning.zero import is_deepspeed, tracked, zero_steps
from ckpt_plugin.measure.contained import contained
from ckpt_plugin.measure.whole_step import Held, StepSplit, split_of
from ckpt_plugin.units import format_bytes

ATTRIBUTE = "batch_size"  # BatchSizeFinder's default batch_arg_name


def check_settable(pl_module: pl.LightningModule) -> None:
    """A ConfigError, before anything is planned, where there is no ``batch_size`` to set."""
    if not lightning_hasattr(pl_module, ATTRIBUTE):
        raise ConfigError([Problem(
            "ckpt.batch",
            f"ckpt.batch=max sets the micro-batch size as Lightning's BatchSizeFinder does, through a `{ATTRIBUTE}` "
            f"attribute of the LightningModule, its hparams or the datamodule, and {type(pl_module).__name__} has "
            "none (nor has its datamodule)",
            f"give the module or the datamodule a `{ATTRIBUTE}` that its train_dataloader reads, or set "
            "ckpt.batch=null")])


def training_sample(trainer: pl.Trainer, pl_module: pl.LightningModule, with_batch: bool = True) -> Sample | None:
    """Under automatic optimization (and ``with_batch``), the first training batch with the module's
    ``training_step`` to its loss, and the call it makes with ``self(...)`` where it makes one (``sample.py``);
    else the sample call alone; None with neither."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with trainer.precision_plugin.forward_context():  # autocast for bf16-mixed, as in training_step
            return pl_module(*args, **kwargs)

    if not pl_module.automatic_optimization or not with_batch:  # manual: its training_step steps the optimizers
        call = sample_call(trainer, pl_module)
        return Sample(call, run) if call is not None else None
    with random_state_kept():
        batch = first_batch(trainer, pl_module)
    call = sample_call(trainer, pl_module, from_batch=True)  # None: training_step calls a child, not self(...)
    if batch is None:
        return Sample(call, run) if call is not None else None

    def step(batch: Any) -> Any:
        with contained(pl_module):  # a counter, a history, a random draw: put back (measure/contained.py)
            return step_loss(trainer, pl_module, batch)

    return Sample(call, run, batch, step)


def memory_plan(trainer: pl.Trainer, pl_module: pl.LightningModule, config: AutoConfig,
                forward: Callable[[], Any] | None, twin: Twin | None = None) -> tuple[WrapPlan, int | None]:
    """``ckpt=auto`` with ``ckpt.memory``: the plan (and, for ``ckpt.batch=max``, the batch) for the whole step
    of this module, the Trainer's optimizers stepping; under FSDP the whole step of ``twin`` (``fsdp.py``), its
    optimizers stepping."""
    sample = training_sample(trainer, pl_module, with_batch=config.sample == STEP)  # ckpt.sample=forward: the call
    optimizers = list(trainer.optimizers) if twin is None else twin.optimizers
    held = tuple(h for h in (strategy_held(trainer, pl_module),) if h is not None)
    steps = _twin_steps(trainer, twin, sample, held) if twin is not None and sample is not None else None
    if steps is None and sample is not None and is_deepspeed(trainer.strategy):  # a ZeRO-1/2 rank's, modelled
        steps = zero_steps(trainer, pl_module, sample, held)
        optimizers = list(steps.steps.optimizers)
    chains = twin is None or twin.regions_allowed(candidates(pl_module, config))  # a layer its own unit: no region
    said = [] if sample is None or sample.step is not None else [
        "  (the whole step measured runs the module's call and sums its output: "
        + ("its training_step steps the optimizers itself" if not pl_module.automatic_optimization else
           "there is no training batch") + ")"]
    if config.batch != "max" or sample is None:
        plan = plan_for(pl_module, config, forward, optimizers=optimizers,
                        step=sample.loss() if sample is not None else None,
                        held=held + ((sample.held(),) if sample is not None else ()), steps=steps, chains=chains)
        return _said(plan, said), None
    names = candidates(pl_module, config)
    # Under FSDP the module is still on the CPU here; the step runs where the strategy puts it (the twin's device).
    limit = resolve_memory(config.read_memory, (twin.device if twin is not None else None) or pl_module.device)
    found = largest_batch(pl_module, names, sample, limit, optimizers, bound=_dataset_length(trainer, pl_module),
                          preserve_rng_state=config.preserve_rng_state, held=held, steps=steps, chains=chains)
    at_batch = None if steps is None else _AtBatch(steps, found.batch)
    plan = plan_for(pl_module, config, sample.forward(found.batch), optimizers=optimizers, timing_forward=forward,
                    step=sample.loss(found.batch), held=(*held, sample.held(found.batch)), steps=at_batch,
                    chains=chains)
    return _said(plan, [*found.lines(limit), *said]), found.batch


def _twin_steps(trainer: pl.Trainer, twin: Twin, sample: Sample, held: tuple[Held, ...]) -> TwinSteps:
    """The whole step on ``twin``: its call through the FSDP root, and its ``training_step`` redirected through it
    as ``FSDPStrategy.training_step`` does (``_forward_redirection``, private to Lightning); under FSDP2 (no root
    wrapper: ``fully_shard`` hooks the module itself) called as ``ModelParallelStrategy`` calls it."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with trainer.precision_plugin.forward_context():
            return twin.wrapped(*args, **kwargs)

    def redirected(batch: Any, batch_idx: int) -> Any:
        return trainer.strategy._forward_redirection(twin.wrapped, twin.module, "training_step", batch, batch_idx)

    def step(batch: Any) -> Any:
        # The twin shares the module's attributes: what training_step does to them is put back (contained.py).
        with contained(twin.module):
            return step_loss(trainer, twin.module, batch, redirected if twin.wrapped is not twin.module else None)

    return TwinSteps(twin, twin_sample(twin, sample, run, step), held)


@dataclass(frozen=True)
class _AtBatch:
    """``steps`` at a fixed batch of ``rows`` samples (the plan made once ``ckpt.batch=max`` found it)."""

    steps: WholeSteps
    rows: int

    def of(self, plan: WrapPlan, rows: int | None = None) -> StepSplit:
        return self.steps.of(plan, self.rows)

    @property
    def device(self) -> torch.device | None:
        return self.steps.device


def strategy_held(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Held | None:
    """What the strategy holds beside the step: under DDP across processes, its reducer's gradient buckets, one
    copy of the gradients (unless ``gradient_as_bucket_view=True`` makes the gradients views into them).

    Measured with 2 gloo ranks (tests/fit_ddp_worker.py): the second step held the parameters' bytes more than
    the step alone (DDP rebuilds its buckets in the second forward, where MemTracker sees them made); on CUDA
    the allocator holds them throughout.
    """
    strategy = trainer.strategy
    if trainer.world_size < 2 or not isinstance(strategy, DDPStrategy) or is_deepspeed(strategy):  # (DeepSpeed's
        # strategy is a DDPStrategy to Lightning; its buffers are the ZeRO model's: zero.py)
        return None
    if getattr(strategy, "_ddp_kwargs", {}).get("gradient_as_bucket_view", False):  # Lightning keeps DDP's kwargs
        return None
    size = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
    return Held(size, "DDP's gradient buckets")


def _said(plan: WrapPlan, lines: list[str]) -> WrapPlan:
    return replace(plan, summary="\n".join([*lines, plan.summary])) if lines else plan


def set_batch_size(trainer: pl.Trainer, pl_module: pl.LightningModule, size: int) -> None:
    """Write ``size`` where BatchSizeFinder does, and have the fit loop build its train dataloader again."""
    lightning_setattr(pl_module, ATTRIBUTE, size)
    # What BatchSizeFinder's _reset_dataloaders does (lightning/pytorch/tuner/batch_size_scaling.py): the loop
    # builds its combined loader again, from the dataloader hook, at its next setup_data.
    trainer.fit_loop._combined_loader = None


def _dataset_length(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    loader = train_dataloader(trainer, pl_module)
    dataset = getattr(loader, "dataset", None)
    try:
        return max(len(dataset), 1) if dataset is not None else MOST
    except TypeError:  # an iterable dataset: no length
        return MOST


class StepWatch:
    """The whole step measured on the second training batch (the first with the gradients and the optimizer's
    state alive before it, as ``ckpt.memory`` plans it): MemTracker, every category, on CPU; on CUDA the
    allocator's peak too (``torch.cuda.max_memory_allocated``, which also counts what MemTracker does not see:
    the batch, the allocator's rounding)."""

    def __init__(self, predicted: StepSplit, limit: int | None = None, batch_passed: bool = False) -> None:
        self.predicted = predicted
        # The strategy's hooks pass the batch through an op (DeepSpeed ZeRO-3 detaches each module's inputs), so
        # MemTracker counts its storage: then it is not added again.
        self.batch_passed = batch_passed
        self.limit = limit  # ckpt.memory in bytes, as the plan resolved it
        self.measured: StepSplit | None = None
        self.cuda_peak: int | None = None
        self._tracker: CategoryPeakTracker | None = None
        self._batch = Held(0, "the batch")
        self._batch_tensors: Any = None

    def start(self, pl_module: pl.LightningModule, optimizers: Sequence[torch.optim.Optimizer], batch: Any) -> None:
        # The batch was made (and moved to the device) before this hook: MemTracker will not see it, the device does.
        self._batch = Held(sum(t.numel() * t.element_size() for t in tree_leaves(batch) if isinstance(t, torch.Tensor)),
                           "the batch")
        self._batch_tensors = batch
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        tracker = CategoryPeakTracker()
        tracker.track_external(pl_module, *tracked(optimizers))
        tracker.__enter__()
        self._tracker = tracker  # entered: abandon() may leave it

    def stop(self, pl_module: pl.LightningModule) -> str | None:
        """The line that compares the step measured with the one predicted; None if it was not started."""
        if self._tracker is None:
            return None
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        seen = seen_bytes(tracker, self._batch_tensors) if self.batch_passed else 0
        batch = Held(self._batch.bytes - seen, self._batch.by)
        self._batch_tensors = None
        self.measured = split_of(tracker, pl_module.device).holding((batch,))
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
            self.cuda_peak = torch.cuda.max_memory_allocated(pl_module.device)
        ratio = self.measured.peak / self.predicted.peak if self.predicted.peak else float("nan")
        cuda = (f"; the CUDA allocator's peak {format_bytes(self.cuda_peak)} ({self.cuda_peak} B)"
                if self.cuda_peak is not None else "")
        return (f"ckpt.memory: the whole step measured at the second batch (MemTracker): {self.measured}; "
                f"predicted {format_bytes(self.predicted.peak)} ({ratio:.3f} of it measured){cuda}")

    def abandon(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None


__all__ = ["ATTRIBUTE", "StepWatch", "check_settable", "memory_plan", "set_batch_size", "strategy_held",
           "training_sample"]

"""What measuring runs under Lightning: the step the trainer runs, its loss included (issue #42).

    step = measured_step(trainer, pl_module, config.sample)   # a MeasuredStep, or None
    step.run()            # training_step on the first training batch, to its loss: effects contained
    step.source           # "training_step on the first training batch", said in the plan's summary

Every measurement the callback makes (``ckpt=auto``'s profile and timing, the
report, the over-keeping check, the offload outlook) runs ``step.run``: the
module's own ``training_step`` on the first training batch, with the layers
found wherever it calls them (``self(...)``, ``self.net(...)``, a loss module),
its loss and metrics included, under the precision plugin's training context,
``self.log`` silenced. ``ckpt.sample`` chooses:

- ``step`` (the default): that step; the module's forward on ``example_input_array``
  where there is no training batch, or the module optimizes manually (its
  ``training_step`` steps the optimizers itself);
- ``forward``: the module's forward on ``example_input_array`` (its output summed),
  where the user gave one; else the step;
- ``none``: nothing is measured (fixed modes: no report, no over-keeping check).

No run of it is one a user can see (``measure/contained.py``): the module's
attributes (counters, histories, an EMA held in a tensor) and the random streams
are put back after each, the batch is drawn from a fresh iterator with the random
states put back, and ``self.log`` logs nothing. What cannot be put back (an
attribute that cannot be copied) is said once per fit, naming it and
``ckpt.sample``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl

from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.lightning.sample import first_batch, random_state_kept, sample_call
from ckpt_plugin.measure.contained import contained

STEP, FORWARD, NONE = "step", "forward", "none"  # ckpt.sample's values
ON_BATCH = "training_step on the first training batch"
ON_EXAMPLE = "the module's forward on example_input_array"


@dataclass
class MeasuredStep:
    """The step measurements run: ``run()`` runs it to its loss, every effect a user could see contained."""

    run: Callable[[], Any]
    source: str  # ON_BATCH or ON_EXAMPLE: what the plan's summary says it was made for
    batch: Any = None  # the first training batch, where the step is training_step's
    uncontained: set[str] = field(default_factory=set)  # what a run could not put back (said once per fit)


@contextlib.contextmanager
def logging_silenced(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing for a moment: a measured step logs nothing (on fake tensors,
    outside the loop Lightning would refuse, inside it would keep a fake value)."""
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None  # instance attributes shadow the methods
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


def step_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
              training_step: Callable[[Any, int], Any] | None = None) -> Any:
    """``training_step(batch, 0)``'s loss (a dict's ``"loss"``), ``self.log`` silenced, under the precision
    plugin's training context; effects not contained (:func:`measured_step`'s forward contains them).
    ``training_step``: how it is called where not directly (FSDP's root redirects it: ``lightning/memory.py``)."""
    with logging_silenced(pl_module), trainer.precision_plugin.train_step_context():
        out = (training_step or pl_module.training_step)(batch, 0)
    return out["loss"] if isinstance(out, Mapping) else out


def measured_step(trainer: pl.Trainer, pl_module: pl.LightningModule, sample: str = STEP) -> MeasuredStep | None:
    """What measuring runs for ``ckpt.sample`` (this module's docstring); None where there is nothing to run."""
    if sample == NONE:
        return None
    example = _example(trainer, pl_module) if sample == FORWARD or not pl_module.automatic_optimization else None
    if example is not None:
        return example
    batch = None
    if pl_module.automatic_optimization:
        with random_state_kept():  # the sampler's seed: the run trains on the batches it would have
            batch = first_batch(trainer, pl_module)
    if batch is None:
        return _example(trainer, pl_module)
    measured = MeasuredStep(lambda: None, ON_BATCH, batch)

    def forward() -> Any:
        with contained(pl_module) as kept:
            loss = step_loss(trainer, pl_module, batch)
        measured.uncontained.update(kept.uncontained)
        return loss

    measured.run = forward
    return measured


def _example(trainer: pl.Trainer, pl_module: pl.LightningModule) -> MeasuredStep | None:
    """The module's forward on ``example_input_array`` (moved and cast as the loop does), or None."""
    call = sample_call(trainer, pl_module)
    if call is None:
        return None
    args, kwargs = call
    measured = MeasuredStep(lambda: None, ON_EXAMPLE)

    def forward() -> Any:
        with contained(pl_module) as kept, trainer.precision_plugin.forward_context():  # autocast, as training
            out = pl_module(*args, **kwargs)
        measured.uncontained.update(kept.uncontained)
        return out

    measured.run = forward
    return measured


def uncontained_warning(step: MeasuredStep) -> str | None:
    """What a measured run could not put back, once, with the key that measures otherwise; None if nothing."""
    if not step.uncontained:
        return None
    return (f"ckpt: measuring ran {step.source} on fake tensors (and, for ckpt=auto, timed it) and could not put "
            f"back {', '.join(sorted(step.uncontained))}: they cannot be copied, so what the measured runs did to "
            "them stays. ckpt.sample=forward measures the module's forward on example_input_array instead, "
            "ckpt.sample=none measures nothing (fixed modes)")


def no_step_error(pl_module: pl.LightningModule) -> ConfigError:
    """ckpt=auto's refusal where there is no step to measure: no training batch (nor a sample), or a module that
    optimizes manually without a sample."""
    name, sample = type(pl_module).__name__, ("`example_input_array` (Lightning's convention for a sample input: a "
                                              "tensor, a tuple of arguments or a dict)")
    if not pl_module.automatic_optimization:
        return ConfigError([Problem("ckpt.mode", f"ckpt=auto measures the step the trainer runs, and {name} optimizes "
                                    "manually (its training_step steps the optimizers itself, so measuring cannot run "
                                    f"it) and has no {sample} to measure its forward on", "set example_input_array")])
    return ConfigError([Problem(
        "ckpt.mode", f"ckpt=auto measures the step the trainer runs, {name}.training_step on the first training "
        f"batch, and there is no train dataloader, nor {sample}",
        "give fit a train dataloader (or the module a train_dataloader()), or set example_input_array")])


__all__ = ["FORWARD", "NONE", "ON_BATCH", "ON_EXAMPLE", "STEP", "MeasuredStep", "logging_silenced", "measured_step",
           "no_step_error", "step_loss", "uncontained_warning"]

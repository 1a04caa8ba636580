"""What the callback says about what it wrapped, besides the report: the report's rows in the model's order, and
a fixed mode's checks on its sample input, or else on the first training batch: the over-keeping check
(``measure/overkeep.py``) and whether an offload mode's copies can hide behind the step (``apply/offload_outlook.py``).

    rows, options = report_rows(pl_module, plan)
    check_fixed_mode(trainer, pl_module, config, wrapped, forward)   # forward None: nothing to measure on
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ckpt_plugin._compat import user_module
from ckpt_plugin.apply.install import warn_overkeep
from ckpt_plugin.apply.offload_outlook import offload_outlook
from ckpt_plugin.config.schema import CkptConfig
from ckpt_plugin.engine.wrap import in_model_order
from ckpt_plugin.lightning.sample import training_call
from ckpt_plugin.lightning.strategies import sharded_parameters
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.report import StepMeasure, WrapReport, how_wrapped, wrap_report, wrapped_line


def report_rows(pl_module: pl.LightningModule, plan: Any) -> tuple[list[str], dict[str, str]]:
    """The layers the report's rows are, in the model's registration order (ckpt=auto: every candidate layer,
    kept ones too, so that its "(rest of model)" is the plan's), and ckpt=auto's option for each ({} for the
    other modes). The plan lists them as they run (issue #33: one order for names)."""
    choices = getattr(plan.planned, "choices", None)
    if not choices:
        return in_model_order(user_module(pl_module), plan.names), {}
    layers = [n for n in choices if not any(n.startswith(f"{a}.") for a in choices)]  # parts are in their layer
    layers = in_model_order(user_module(pl_module), layers)
    return layers, {n: str(choices[n]) for n in layers}  # the report names them


def batch_forward(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Callable[[], Any] | None:
    """The call ``training_step`` makes with ``batch`` (``sample.training_call``), as a forward; None if none."""
    call = training_call(trainer, pl_module, batch)
    if call is None:
        return None
    args, kwargs = call

    def forward() -> Any:
        with trainer.precision_plugin.forward_context():  # autocast for bf16-mixed, as in training_step
            return pl_module(*args, **kwargs)

    return forward


def check_fixed_mode(trainer: pl.Trainer, pl_module: pl.LightningModule, config: CkptConfig, wrapped: list[str],
                     forward: Callable[[], Any] | None = None, batch: Any = None) -> None:
    """Warn on rank 0 where a fixed mode keeps more on a layer than no checkpointing (``apply.warn_overkeep``), and
    where its offload moves more than the link carries while the step computes (``offload_outlook``), once each.

    ``forward``: the sample's; else the call ``training_step`` makes with ``batch`` (found only once the check
    is to run: finding it runs ``training_step`` up to that call). Skipped without either, and where parameters
    are sharded: a forward on fake tensors would run into the parameters the strategy shards, as the report's
    would (``strategies.sharded_parameters``)."""
    if trainer.global_rank != 0 or sharded_parameters(trainer.strategy) is not None:
        return
    if forward is None and batch is not None:
        forward = batch_forward(trainer, pl_module, batch)
    if forward is None:
        return
    warn_overkeep(pl_module, config, wrapped, forward, warn=lambda text: rank_zero_warn(text, category=UserWarning))
    outlook = offload_outlook(pl_module, config, wrapped, forward)
    if outlook is not None:
        rank_zero_warn(outlook, category=UserWarning)


def say_what_was_wrapped(pl_module: pl.LightningModule, config: CkptConfig, names: list[str], plan: Any,
                         forward: Callable[[], Any] | None, unmeasured: str | None,
                         without: StepMeasure | NotFakeable | None, rows: Any, options: Any) -> WrapReport | None:
    """The wrapped line, and the report of what the step keeps with and without (``measure/report.py``)
    where it can be measured on fake tensors (``unmeasured``: why it cannot, ``strategies.fake_step_refused``);
    the report, or None."""
    how = how_wrapped(config.mode, options)
    wrapped = f"{wrapped_line(len(names), type(pl_module).__name__, how)}: {', '.join(names)}."
    report = None
    if forward is None:
        why = ("ckpt.sample=none: nothing is measured" if config.sample == "none" else
               f"there is no training batch to measure the step on (nor `example_input_array` on "
               f"{type(pl_module).__name__})")
        rank_zero_info(f"{wrapped} ({why}, so the activation memory this saves is not reported.)")
    elif unmeasured is not None:
        rank_zero_info(f"{wrapped} Their kept bytes are not reported {unmeasured}.")
    elif isinstance(without, NotFakeable):  # counted on fake tensors or not at all: never on real ones
        rank_zero_info(f"{wrapped} Their kept bytes are not reported: {without}")
    else:
        planned = (plan.planned.predicted_peak, plan.planned.budget_bytes) if options else None
        try:
            report = wrap_report(pl_module, names, forward, how=how, rows=rows, options=options,
                                 without=without, planned=planned, peaks=bool(options))
            if plan.fit is not None:  # ckpt.memory planned the activations for the budget its whole step allows
                report.budget_is = "the activation budget ckpt.memory allows"
        except NotFakeable as err:
            rank_zero_info(f"{wrapped} Their kept bytes are not reported: {err}")
        else:
            rank_zero_info(str(report))
    return report


__all__ = ["batch_forward", "check_fixed_mode", "report_rows", "say_what_was_wrapped"]

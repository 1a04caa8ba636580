"""``ActivationCheckpointing``: the Lightning callback behind ``callbacks: activation_checkpointing``.

When it wraps: ``on_fit_start``. Lightning calls a callback's ``setup``
*before* ``LightningModule.configure_model``, so layers built there (the usual
place under FSDP, DeepSpeed ZeRO-3 or meta-device init) do not exist yet in
``setup``. ``on_fit_start`` runs after ``configure_model`` and after the
strategy has wrapped the model (DDP, FSDP, DeepSpeed), and before the sanity
check and the first batch, so every layer is there and nothing has run yet.
``teardown`` (or ``on_exception``) unwraps, leaving the module as it was given to ``fit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info

from ckpt_plugin.config.plan import plan_for
from ckpt_plugin.config.schema import AutoConfig, NoneConfig, as_keys, make_config
from ckpt_plugin.engine.wrap import install, policy_of, remove_checkpointing
from ckpt_plugin.lightning.strategies import prepare
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.memory import SavedCounter
from ckpt_plugin.measure.report import WrapReport, wrap_report
from ckpt_plugin.measure.sample import call_args


class ActivationCheckpointing(pl.Callback):
    """Checkpoint the layers named by the keys of the ``ckpt`` config node.

    >>> trainer = Trainer(callbacks=[ActivationCheckpointing(layers="TransformerBlock")])

    The keys are checked here, when the callback is built; the layer names
    are checked against the model when fitting starts, before anything is
    wrapped.
    """

    def __init__(self, **ckpt_keys: Any) -> None:
        super().__init__()
        self.config = make_config(**ckpt_keys)
        self.wrapped: list[str] = []  # qualified names wrapped in the current fit
        self.report: WrapReport | None = None
        self.planned: Any = None  # ckpt=auto's Plan: predicted activation peak and step time
        self._policy: Any = None  # the selective policy until its names are checked
        self._counter: SavedCounter | None = None  # this step's saved bytes, on logged steps
        self._counting: Any = None  # its hooks, between batch start and backward

    @property
    def state_key(self) -> str:
        return self._generate_state_key(**as_keys(self.config))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(self.config, NoneConfig):
            rank_zero_info("Activation checkpointing is off (ckpt=none).")
            return
        prepare(trainer.strategy, pl_module, self.config)
        forward = self._example_forward(trainer, pl_module)
        if isinstance(self.config, AutoConfig):
            rank_zero_info("ckpt=auto: measuring the candidate layers (memory on fake tensors, step time one "
                           "layer at a time) to plan for ckpt.budget...")
        plan = plan_for(pl_module, self.config, forward)
        if plan.summary:
            rank_zero_info(plan.summary)
        self.planned = plan.planned
        self.wrapped = install(pl_module, plan)
        self._policy = policy_of(pl_module)
        if forward is None:
            rank_zero_info(
                f"Activation checkpointing wrapped {len(self.wrapped)} module(s): "
                f"{', '.join(self.wrapped)}. (Set `example_input_array` on "
                f"{type(pl_module).__name__} to see the activation memory this saves.)"
            )
            return
        try:
            self.report = wrap_report(pl_module, self.wrapped, forward)
        except NotFakeable as err:  # counted on fake tensors or not at all: never on real ones
            rank_zero_info(f"Activation checkpointing wrapped {len(self.wrapped)} module(s): "
                           f"{', '.join(self.wrapped)}. Their saved bytes are not reported: {err}")
        else:
            rank_zero_info(str(self.report))
        self._check_names()

    @staticmethod
    def _example_forward(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[], Any] | None:
        """A forward of ``example_input_array`` prepared as Lightning prepares a batch, or None."""
        example = pl_module.example_input_array
        if example is None:
            return None
        # To the device, then to the precision's dtype (64-true), as the loop does with a batch.
        example = trainer.precision_plugin.convert_input(move_data_to_device(example, pl_module.device))
        args, kwargs = call_args(example)

        def forward() -> Any:
            with trainer.precision_plugin.forward_context():  # autocast for bf16-mixed, as in training_step
                return pl_module(*args, **kwargs)

        return forward

    # -- per-step metrics, on the steps Lightning logs (trainer.log_every_n_steps) --------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.wrapped or trainer.global_step % max(trainer.log_every_n_steps, 1):
            return
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._counter = SavedCounter(pl_module)
        self._counting = self._counter.hooks()
        self._counting.__enter__()  # left in on_before_backward: counts what the forward saves

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._stop_counting()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._check_names()  # without example_input_array, the first step is the first forward
        self._stop_counting()
        if self._counter is None:
            return
        metrics = {"ckpt/saved_activation_bytes": float(self._counter.result.total)}
        if self.report is not None:
            metrics["ckpt/bytes_saved_by_checkpointing"] = float(self.report.without.total - self.report.with_ckpt.total)
        if self.planned is not None:  # beside what the step measures: what ckpt=auto predicted
            metrics["ckpt/predicted_activation_peak_bytes"] = float(self.planned.predicted_peak)
        if pl_module.device.type == "cuda":
            metrics["ckpt/cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(pl_module.device))
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        self._counter = None

    def _stop_counting(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def _check_names(self) -> None:
        """ckpt.save_names/exclude_names that no checkpoint_name used: an error once a forward has run."""
        if self._policy is not None and self._policy.uses_names:
            policy, self._policy = self._policy, None  # checked once per fit
            policy.check_names()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            remove_checkpointing(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips teardown when fit raises; unwrap here so the module is still left as it was given.
        self._stop_counting()
        remove_checkpointing(pl_module)

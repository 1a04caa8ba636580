"""``ActivationCheckpointing``: the Lightning callback behind ``callbacks: activation_checkpointing``.

Its keyword arguments are the keys of the ``ckpt`` config node, typed and
documented, so Hydra (``instantiate`` on the node) and LightningCLI
(``--trainer.callbacks.layers=Block``, or ``init_args`` in its YAML) build it
alike, and ``fit --trainer.callbacks.help ckpt_plugin.ActivationCheckpointing``
lists them.

When it checks: the keys when it is built; the layer selection in ``setup``,
before ``configure_optimizers`` and the first batch. Lightning calls a
callback's ``setup`` *before* ``LightningModule.configure_model``, so when
nothing matches yet and the module builds layers in ``configure_model`` (or its
own ``setup``), the check waits for ``on_fit_start``.

When it wraps: ``on_fit_start``. It runs after ``configure_model`` and after the
strategy has wrapped the model (DDP, FSDP, DeepSpeed), and before the sanity
check and the first batch, so every layer is there and nothing has run yet.
``teardown`` (or ``on_exception``) unwraps, leaving the module as it was given to ``fit``.

What a checkpoint records: :meth:`ActivationCheckpointing.state_dict`, under
the key ``ActivationCheckpointing`` (Lightning's default ``state_key``, the
class name: one instance per Trainer), with ``ckpt=auto``'s plan as plain data
(``planning/plan_file.py``). A resume with other keys warns once, naming each
change, goes on with this run's keys and plans anew; with the same keys it
installs the checkpoint's plan without planning, where Lightning restores a
callback's state before ``on_fit_start`` (every strategy whose
``restore_checkpoint_after_setup`` is false: single device, DDP). FSDP, FSDP2 and
DeepSpeed restore it after, and cannot plan (below): there ``ckpt.plan=<its
ckpt_plan.json>`` gives the resumed run the old plan.

One plan on every rank (``ckpt=auto``): under several processes rank 0 plans
and ``trainer.strategy.broadcast`` hands its plan, as plain data, to every rank,
which installs it. Under DDP without SyncBatchNorm the other ranks wait at the
broadcast: the profile runs the LightningModule's own ``training_step``, which issues
no collective (``step.py``; a step that communicates is measured on its forward with
``ckpt.sample=forward``). With SyncBatchNorm (its forward all-gathers statistics) every rank
profiles in lockstep and installs rank 0's plan. Rank 0 writes the plan it
installed to ``ckpt_plan.json`` in the Trainer's log dir, for ``ckpt.plan=`` to rerun it.

Under ``FSDPStrategy``, ``ModelParallelStrategy`` (FSDP2) and DeepSpeed, ``ckpt=auto``
plans in ``setup``, before the strategy shards the module or hooks its parameters: run
with 2 gloo processes on CPU, a profile at fit start met FSDP's flat 1-D shards ("'weight'
must be 2-D"), left FSDP2 training the next step on fake all-gathered parameters, and
fed DeepSpeed's gradient hooks fake gradients ("Cannot copy out of meta tensor"; ZeRO-1,
2 and 3). Rank 0 profiles the whole module (with ``ckpt.memory``, under FSDP and FSDP2,
every whole step on a fake twin the strategy shards: ``fsdp.py``), and every rank installs
the plan at fit start under the names the strategy's wrapping gave the same modules. Under
DeepSpeed only the activations are planned (``ckpt.budget``); its whole step is refused
(``strategies.planning_refused``). The wrap report's fake step is skipped where parameters
are sharded (FSDP, FSDP2, ZeRO-3) or, for ckpt=auto's backward, hooked (ZeRO-1 and 2):
``strategies.fake_step_refused``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from ckpt_plugin import __version__
from ckpt_plugin._compat import user_module
from ckpt_plugin.apply.install import Installation, install_plan
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.apply.twin import names_after_wrapping, renamed
from ckpt_plugin.config.keys import args_section
from ckpt_plugin.config.schema import (
    MODES,
    AutoConfig,
    CkptConfig,
    FullConfig,
    NoneConfig,
    as_keys,
    make_config,
)
from ckpt_plugin.engine.wrap import check_plan, remove_checkpointing
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.lightning.agreed import agreed_plan
from ckpt_plugin.lightning.keys_changed import config_changes
from ckpt_plugin.lightning.memory import StepWatch, check_settable, set_batch_size
from ckpt_plugin.lightning.step import (
    NONE,
    ON_BATCH,
    MeasuredStep,
    measured_step,
    no_step_error,
    uncontained_warning,
)
from ckpt_plugin.lightning.strategies import fake_step_refused, planning_refused, plans_before_wrapping, prepare
from ckpt_plugin.lightning.wrapped import check_fixed_mode, report_rows, say_what_was_wrapped
from ckpt_plugin.lightning.zero import is_zero3
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.memory import SavedCounter
from ckpt_plugin.measure.report import StepMeasure, WrapReport, measure_step
from ckpt_plugin.planning.plan_file import (
    FILE_NAME,
    plain,
    plan_to_dict,
    save_plan,
)


class ActivationCheckpointing(pl.Callback):
    """Checkpoint the layers named by the keys of the ``ckpt`` config node.

    >>> trainer = Trainer(callbacks=[ActivationCheckpointing(layers="TransformerBlock")])

    A key left unset (None; null in YAML) takes the mode's default; a key the
    mode does not have is an error when it is given (``mode="full",
    budget="1GiB"``). The keys are checked here, when the callback is built;
    the layers against the model in ``setup``, before anything is wrapped.

    The keys' meanings follow (``config/keys.py``: the one place they are written).

    """

    def __init__(
        self,
        *,
        mode: str = "full",
        layers: str | list[str] | None = None,
        every_n: int | None = None,
        sample: str | None = None,
        preserve_rng_state: bool | None = None,
        check_recompute: bool | None = None,
        segments: int | str | None = None,
        offload: bool | None = None,
        policy: str | list[str] | None = None,
        save_names: str | list[str] | None = None,
        exclude_names: str | list[str] | None = None,
        budget: int | float | str | None = None,
        memory: int | float | str | None = None,
        batch: str | None = None,
        deepspeed: dict[str, Any] | None = None,
        compile: bool | str | None = None,  # noqa: A002 -- the key's name in the ckpt node
        timing: str | None = None,
        plan: str | None = None,
        **misspelt: Any,
    ) -> None:
        super().__init__()
        keys = {
            "layers": layers, "every_n": every_n, "sample": sample, "preserve_rng_state": preserve_rng_state,
            "check_recompute": check_recompute, "segments": segments, "offload": offload, "policy": policy,
            "save_names": save_names, "exclude_names": exclude_names, "budget": budget, "memory": memory,
            "batch": batch, "deepspeed": deepspeed, "compile": compile, "timing": timing, "plan": plan,
        }
        # None is "the mode's default": left out, so a key the mode lacks is an error only when it is given
        # (Hydra's instantiate hands over every key of the mode's node, its nulls included). Any other
        # keyword is a misspelt key: make_config names it with the closest valid one, where Python would
        # only say "unexpected keyword argument" (jsonargparse never passes one: it refuses them itself).
        given = {k: v for k, v in keys.items() if v is not None}
        self.config = make_config(mode=mode, **given, **misspelt)
        self.wrapped: list[str] = []  # qualified names wrapped in the current fit
        self.report: WrapReport | None = None
        self.planned: Any = None  # ckpt=auto's Plan: predicted activation peak and step time
        self.plan_path: Path | None = None  # where rank 0 wrote the plan this fit planned (ckpt=auto)
        self._plan: dict[str, Any] | None = None  # ckpt=auto: the plan installed, as data (state_dict)
        self._resumed: dict[str, Any] | None = None  # the checkpoint's plan, when its keys are this run's
        self._installed: Installation | None = None  # what on_fit_start installed: its names checked after a step
        self._counter: SavedCounter | None = None  # this step's saved bytes, on logged steps
        self._counting: Any = None  # its hooks, between batch start and backward
        self._overkeep_at_step = False  # the over-keeping check waits for the first batch (no sample at fit start)
        self.batch_size: int | None = None  # ckpt.batch=max: the micro-batch set for this fit
        self.step_watch: StepWatch | None = None  # ckpt.memory: the whole step predicted, and measured at batch 2
        self._batches = 0  # training batches of this fit so far
        self._early: tuple[Any, dict[str, nn.Module]] | None = None  # FSDP: the plan made in setup, its modules
        self._step_said = False  # what the measurements run, said in this fit (in setup under FSDP or DeepSpeed)

    # -- the checkpoint's record: what this fit was trained with ----------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The keys (mode included), the modules this fit wrapped, the plugin's version and, for ckpt=auto, the
        plan installed (``plan_file.plan_to_dict``); plain Python."""
        state = {"config": plain(as_keys(self.config)), "wrapped": list(self.wrapped), "version": __version__}
        if self._plan is not None:
            state["plan"] = self._plan
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Warn once, naming each change, when the checkpoint was trained with other keys (this run then plans
        anew); with the same keys, keep the checkpoint's ckpt=auto plan for ``on_fit_start`` to install."""
        saved = state_dict.get("config")
        if not isinstance(saved, dict):  # a record without the keys: nothing to compare
            return
        # A record from before a key existed (ckpt.compile, ckpt.timing, ...) ran with that key's default.
        mode = MODES.get(saved.get("mode"))
        defaults = {f.name: f.default for f in fields(mode) if f.default is not MISSING} if mode else {}
        saved = {**defaults, **saved}
        changes = config_changes(saved, plain(as_keys(self.config)))
        if changes:
            rank_zero_warn(
                f"{type(self).__name__}: this run's ckpt config differs from the checkpoint's: {', '.join(changes)}. "
                "Training resumes with this run's config (activation checkpointing does not change the weights, "
                "only memory and time)."
            )
        elif isinstance(state_dict.get("plan"), dict) and isinstance(self.config, AutoConfig):
            if self.wrapped:  # restored after on_fit_start (FSDP, DeepSpeed): this fit planned already
                rank_zero_info(f"{type(self).__name__}: the checkpoint's ckpt=auto plan was restored after this run "
                               "planned (the strategy restores callbacks after on_fit_start); the run keeps the "
                               "plan it installed")
            else:
                self._resumed = state_dict["plan"]

    # -- fit: check at setup, wrap at fit start ----------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or isinstance(self.config, NoneConfig):
            return
        self._step_said = False
        refused = planning_refused(trainer.strategy, self.config)
        if refused is not None:
            raise refused
        if isinstance(self.config, AutoConfig) and self.config.batch == "max" and self.config.plan is None:
            check_settable(pl_module)  # before anything is planned: where the batch size would be written
        # ckpt=auto under FSDP, FSDP2 and DeepSpeed plans here (or reads ckpt.plan), while the module is whole:
        # ckpt.memory on lightning/fsdp.py's twin. The plan names the module's layers; fit start renames it to the
        # names the strategy's wrapping gave them.
        before_sharding = isinstance(self.config, AutoConfig) and plans_before_wrapping(trainer.strategy)
        try:
            _check_on(pl_module, self.config)
        except ConfigError as err:
            # Lightning calls configure_model (and the module's own setup) after this hook: layers built
            # there do not exist yet. on_fit_start checks again, once they do.
            built_later = any(is_overridden(hook, pl_module)
                              for hook in ("configure_model", "configure_sharded_model", "setup"))
            if built_later and before_sharding:
                key = "ckpt.memory" if self.config.read_memory is not None else "ckpt.mode"
                raise ConfigError([*err.problems, Problem(
                    key,
                    f"under {type(trainer.strategy).__name__} ckpt=auto plans in the callback's setup, while the "
                    f"module is whole, before {type(pl_module).__name__}.configure_model (or setup) builds layers",
                    "build the layers in __init__, or plan on one process (a ckpt=auto run writes ckpt_plan.json) "
                    "and give the file with ckpt.plan=<file>")]) from err
            if built_later:
                return
            raise
        if before_sharding:
            self._plan_before_sharding(trainer, pl_module)

    def _plan_before_sharding(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """ckpt=auto under FSDP, FSDP2 or DeepSpeed: rank 0 plans on the whole module (ckpt.memory: every whole step on
        the fake twin the strategy shards, ``fsdp.py``); every rank gets the plan (installed at fit start) and sets
        the batch. A plan given with ``ckpt.plan`` is read against the whole module too, so it installs whatever
        units FSDP makes.
        The plan kept (``ckpt_plan.json``, the checkpoint) names the module's own layers."""
        before = dict(user_module(pl_module).named_modules())
        if self.config.plan is not None:
            self._early = (plan_for(pl_module, self.config), before)
            return
        on_meta = [name for name, p in pl_module.named_parameters() if p.is_meta]
        if on_meta:  # trainer.init_module(empty_init=True): the strategy materializes them after this hook
            raise ConfigError([Problem(
                "ckpt.mode",
                f"ckpt=auto plans in the callback's setup, before {type(trainer.strategy).__name__} shards the module, "
                f"and {type(pl_module).__name__}'s parameters are on the meta device ({len(on_meta)} of them, "
                f"{on_meta[0]} first: trainer.init_module(empty_init=True)), where no step can run",
                "build the module with trainer.init_module(empty_init=False) (its parameters in host memory until "
                "the strategy shards them), or give a plan made so with ckpt.plan=<its ckpt_plan.json>, or choose "
                "a fixed mode (ckpt=full, ckpt=selective, ckpt=offload)")])
        step = self._measured(trainer, pl_module, planning=True)
        plan, batch = self._agreed_plan(trainer, pl_module, step.run, before_sharding=True)
        if batch is not None:
            set_batch_size(trainer, pl_module, batch)
            self.batch_size = batch
        self._keep(trainer, pl_module, plan)
        self._early = (plan, before)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(self.config, NoneConfig):
            rank_zero_info("Activation checkpointing is off (ckpt=none).")
            return
        prepare(trainer.strategy, pl_module, self.config)
        early, self._early = self._early, None  # planned in setup, before the strategy sharded the module
        planning = isinstance(self.config, AutoConfig) and self.config.plan is None and early is None
        step = self._measured(trainer, pl_module, planning=planning)
        forward = step.run if step is not None else None
        if early is not None:  # the same modules, named as the strategy's wrapping named them
            plan = renamed(early[0], names_after_wrapping(early[1], pl_module))
        elif planning:
            plan, batch = self._agreed_plan(trainer, pl_module, forward)
            if batch is not None:
                set_batch_size(trainer, pl_module, batch)
                self.batch_size = batch
                step = self._measured(trainer, pl_module, planning=True)  # the report: the step as it will run
                forward = step.run
        else:
            plan = plan_for(pl_module, self.config, forward)
        if plan.summary:
            rank_zero_info(plan.summary)
        self.planned = plan.planned
        self._batches = 0
        self.step_watch = StepWatch(plan.fit.split, plan.fit.limit, batch_passed=is_zero3(trainer.strategy)
                                    ) if plan.fit is not None else None
        rows, options = report_rows(pl_module, plan)
        unmeasured = fake_step_refused(trainer.strategy, backward=bool(options))
        without: StepMeasure | NotFakeable | None = None  # the step as given, before anything is installed
        # The peaks (a fake backward under MemTracker) cost as much again per fit and, found by ckpt-soak, leave the
        # fake copies of the parameters alive after it: measured only for ckpt=auto, whose plan they check.
        if forward is not None and unmeasured is None:
            try:
                without = measure_step(pl_module, forward, rows, peaks=bool(options))
            except NotFakeable as err:  # counted on fake tensors or not at all: never on real ones
                without = err
        self._installed = install_plan(pl_module, plan)
        self.wrapped = self._installed.names
        if planning:
            self._keep(trainer, pl_module, plan)
        self.report = say_what_was_wrapped(pl_module, self.config, self.wrapped, plan, forward, unmeasured, without,
                                           rows, options)
        self._overkeep_at_step = forward is None and not isinstance(self.config, AutoConfig) and \
            self.config.sample != NONE
        if forward is not None:  # without a sample, the first step is the first forward: checked after it
            self._check_names()
            check_fixed_mode(trainer, pl_module, self.config, self.wrapped, forward)
            said = uncontained_warning(step)
            if said is not None:
                rank_zero_warn(said, category=UserWarning)

    def _measured(self, trainer: pl.Trainer, pl_module: pl.LightningModule, planning: bool) -> MeasuredStep | None:
        """What this fit's measurements run (``step.py``: ckpt.sample), said once a fit (setup may have said it);
        ``planning``: ckpt=auto, which cannot plan without it (a ConfigError that says what it needs)."""
        step = measured_step(trainer, pl_module, self.config.sample)
        if step is None and planning:
            raise no_step_error(pl_module)
        if step is not None and not self._step_said:
            self._step_said = True
            rank_zero_info(f"ckpt: measuring runs {step.source}" + (
                " (ckpt.sample=forward measures the module's forward on example_input_array instead)"
                if step.source == ON_BATCH and pl_module.example_input_array is not None else ""))
        return step

    # -- ckpt=auto: one plan on every rank, kept --------------------------------------------------

    def _agreed_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, forward: Callable[[], Any] | None,
                     before_sharding: bool = False) -> tuple[Any, int | None]:
        """The plan every rank installs and the batch ckpt.batch=max found (``agreed.py``): the checkpoint's plan
        on a resume with the same keys, else rank 0's."""
        resumed, self._resumed = self._resumed, None
        return agreed_plan(trainer, pl_module, self.config, forward, resumed, before_sharding)

    def _keep(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Any) -> None:
        """Keep the plan installed: in the state_dict, and on rank 0 as ``ckpt_plan.json`` in the log dir."""
        self._plan = plan_to_dict(plan, pl_module)
        where = trainer.log_dir or trainer.default_root_dir  # log_dir is a collective: every rank asks
        if trainer.global_rank != 0:
            return
        try:
            self.plan_path = save_plan(plan, Path(where) / FILE_NAME, pl_module)
        except OSError as err:  # a read-only log dir costs the file, not the run
            rank_zero_warn(f"ckpt=auto: the plan could not be written to {where}: {err}")
            return
        rank_zero_info(f"ckpt=auto: the plan installed is in {self.plan_path}; ckpt.plan={self.plan_path} "
                       "installs it again without planning")

    # -- per-step metrics, on the steps Lightning logs (trainer.log_every_n_steps) --------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             *args: Any) -> None:
        if self.step_watch is not None and self._batches == 1:  # the first step with gradients and state alive
            self.step_watch.start(pl_module, trainer.optimizers, batch)
        if self._overkeep_at_step and self.wrapped:  # the batch is the sample now: on fake tensors, once per fit
            self._overkeep_at_step = False
            check_fixed_mode(trainer, pl_module, self.config, self.wrapped, batch=batch)
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
        self._batches += 1
        if self.step_watch is not None:
            said = self.step_watch.stop(pl_module)
            if said is not None:
                rank_zero_info(said)
                measured = self.step_watch.measured
                pl_module.log_dict({"ckpt/whole_step_peak_bytes": float(measured.peak),
                                    "ckpt/predicted_whole_step_peak_bytes": float(self.step_watch.predicted.peak)},
                                   on_step=True, on_epoch=False)
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
        if self._installed is not None:
            self._installed.check_names()  # once per fit

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            remove_checkpointing(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips teardown when fit raises; unwrap here so the module is still left as it was given.
        self._stop_counting()
        if self.step_watch is not None:
            self.step_watch.abandon()
        remove_checkpointing(pl_module)


# The keys' help, written once (config/keys.py): what jsonargparse's --help and help() print.
ActivationCheckpointing.__doc__ = f"{ActivationCheckpointing.__doc__.rstrip()}\n\n{args_section()}\n"


def _check_on(model: nn.Module, config: CkptConfig) -> None:
    """What ``config`` asks of ``model`` that needs no forward: the layer selection and a segment chain."""
    if isinstance(config, AutoConfig) and config.plan is not None:  # the file's plan, checked against the model
        check_plan(user_module(model), plan_for(model, config))
        return
    if isinstance(config, AutoConfig):  # its plan needs a profile, a forward: here only the layers it would profile
        config = FullConfig(layers=config.layers, every_n=config.every_n)
    check_plan(user_module(model), plan_for(model, config))  # what install() checks before touching the model

"""One config becomes one plan: what the engine installs, for every mode, ``auto`` included.

    plan = plan_for(model, make_config(layers="TransformerBlock"))   # WrapPlan: what and how

:func:`plan_for` is the only place that reads a validated ``ckpt`` config and
decides what the engine does: which modules (``engine/selection.py``), how each
call runs (``treatment.py``), one checkpoint per layer or segments over a chain
(``segments.py``), or, for ``ckpt=auto``, what the planner chose from a profile
(``auto.py``). It dispatches on the config's type and never touches the model;
``install.py`` puts the plan on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import user_module
from ckpt_plugin.apply.auto import auto_plan, given_plan
from ckpt_plugin.apply.memory import WholeSteps
from ckpt_plugin.apply.segments import chain_problems, optimal_plan
from ckpt_plugin.apply.treatment import compiled_line, treatment_of
from ckpt_plugin.config.schema import AutoConfig, CkptConfig, NoneConfig
from ckpt_plugin.config.values import backend_of
from ckpt_plugin.engine.plan import EachLayer, Segments, WrapPlan
from ckpt_plugin.engine.selection import resolve_layers, select_layers
from ckpt_plugin.engine.wrap import check_plan
from ckpt_plugin.errors import ConfigError, Problem, raise_problems
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.sample import example_forward
from ckpt_plugin.measure.values import recorded_values, values_line, with_values_replayed
from ckpt_plugin.measure.whole_step import Held


def plan_for(model: nn.Module, config: CkptConfig, forward: Callable[[], Any] | None = None, *,
             optimizers: Sequence[torch.optim.Optimizer] = (),
             timing_forward: Callable[[], Any] | None = None, step: Callable[[], Any] | None = None,
             held: Sequence[Held] = (), steps: WholeSteps | None = None, chains: bool = True) -> WrapPlan:
    """The plan ``config`` asks for on ``model``; raises, naming the keys, when it cannot be honoured.

    ``forward()`` runs the model on a sample input, for ``ckpt=auto``'s
    profile and the segments' chain check (on fake tensors); by default
    ``model(model.example_input_array)``, if it has one. ``model`` may be
    wrapped (compiled, DDP, FSDP, Fabric): the plan names the modules of the user's own module.
    ``optimizers``: what the training step steps, for ``ckpt.memory``'s whole step (their state is counted);
    ``timing_forward``: ``ckpt=auto``'s options are timed on it; ``step``: the training step to its loss, which
    ``ckpt.memory``'s whole step runs (``auto.auto_plan``; default ``forward``); ``held``: what the device holds
    beside the step (the batch, DDP's gradient buckets); ``steps``: how the whole step is measured, where not on
    ``model`` itself (``memory.WholeSteps``: under FSDP, a fake twin as the strategy shards it); ``chains``: False
    where the layers will not run where they sit (each its own FSDP unit): no region over several of them.
    """
    given, model = model, user_module(model)
    if isinstance(config, NoneConfig):
        return WrapPlan()
    if isinstance(config, AutoConfig) and config.plan is not None:
        return given_plan(model, config)
    layers, note = resolve_layers(model, config.layers)
    note = note or ""
    names = select_layers(model, layers, config.every_n)
    if isinstance(config, AutoConfig):
        forward = forward or sample_forward(model)
        return planned(model, forward, "ckpt.mode", lambda: auto_plan(
            given, model, config, names, forward, note, optimizers, timing_forward, step, held, steps, chains))
    segments = getattr(config, "segments", None)
    if segments is None:
        backend = backend_of(config.compile)
        summary = "\n".join(filter(None, [note, compiled_line(config, backend, len(names))]))
        return WrapPlan((EachLayer(tuple(names), treatment_of(config), compile=backend),), summary=summary, note=note)
    if config.every_n != 1:
        raise_problems([Problem(
            "ckpt.segments",
            f"ckpt.segments={segments} cannot be combined with ckpt.every_n={config.every_n}: "
            "segments group consecutive layers", "drop one of the two")])
    optimal = segments == "optimal"  # planned below, once the layers are known to be a chain
    group = Segments(tuple(names), 1 if optimal else segments, treatment_of(config))
    plan = WrapPlan((group,), summary=note, note=note)
    check_plan(model, plan)  # where the layers sit, first: nothing runs for layers that cannot be a chain
    if optimal:
        forward = forward or sample_forward(model, "ckpt.segments", "ckpt.segments=optimal")
    elif forward is None and getattr(model, "example_input_array", None) is not None:
        forward = example_forward(model)
    if forward is None:
        return plan

    def checked() -> WrapPlan:
        raise_problems(chain_problems(model, names, forward), "ckpt.segments")
        return optimal_plan(model, config, names, forward, note) if optimal else plan

    return planned(model, forward, "ckpt.segments", checked)


def candidates(model: nn.Module, config: AutoConfig) -> list[str]:
    """The qualified names ``ckpt=auto`` plans over (``ckpt.layers``, ``every_n``), as :func:`plan_for` finds them."""
    model = user_module(model)
    layers, _note = resolve_layers(model, config.layers)
    return select_layers(model, layers, config.every_n)


def planned(model: nn.Module, forward: Callable[[], Any], key: str, plan: Callable[[], WrapPlan]) -> WrapPlan:
    """``plan()``, whose measurements on fake tensors share one record of what ``forward`` reads from values
    (``measure/values.py``); a forward that still cannot run on them is the config's to change: a ConfigError."""
    before = recorded_values(model)
    try:
        made = with_values_replayed(model, forward, plan)
    except NotFakeable as err:
        fixed = "ckpt=full, selective or offload with the same ckpt.layers" if key == "ckpt.mode" else \
            "ckpt.segments=<a number> (no profile)"
        raise ConfigError([Problem(key, str(err), f"a fixed mode needs no measurement: {fixed}")]) from err
    record = recorded_values(model)
    if record is None or record is before:
        return made
    return replace(made, summary="\n".join(filter(None, [made.summary, values_line(record)])))


def sample_forward(model: nn.Module, key: str = "ckpt.mode", who: str = "ckpt=auto") -> Callable[[], Any]:
    """``model(example_input_array)``; a model without one is the user's to fix, so a ConfigError."""
    if getattr(model, "example_input_array", None) is None:
        raise_problems([Problem(
            key,
            f"{who} measures the step it plans for: give apply_checkpointing(..., step=<a callable that runs the "
            f"training step and returns its loss>), or set `example_input_array` on {type(model).__name__} "
            "(Lightning's convention: a tensor, a tuple of arguments or a dict)",
            "or choose another ckpt preset (under Lightning's callback, training_step on the first training batch "
            "serves)",
        )])
    return example_forward(model)


__all__ = ["candidates", "plan_for", "sample_forward"]

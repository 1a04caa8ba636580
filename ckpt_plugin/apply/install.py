"""The spine: a model and a ``ckpt`` config in, the plan installed (``config -> plan -> install``).

    apply_checkpointing(model, layers="TransformerBlock")     # the keys of the ckpt node
    apply_config(model, make_config(...), forward)            # a config already built

Every surface (the torch API, the Lightning callback, Fabric, LightningCLI,
``ckpt-inspect``) comes through :func:`plan_for` and the engine's ``install``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ckpt_plugin._compat import user_module
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import AutoConfig, CkptConfig, NoneConfig, make_config
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.engine.wrap import install, policy_of
from ckpt_plugin.measure.contained import contained
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.overkeep import over_kept, overkeep_warning
from ckpt_plugin.measure.sample import example_forward

log = logging.getLogger("ckpt_plugin")


@dataclass
class Installation:
    """A plan installed on a model: the modules wrapped, and the one check left until a forward has run.

    With ``ckpt.policy=names`` a name in ``ckpt.save_names``/``exclude_names`` that
    no ``checkpoint_name`` used would save nothing, silently; only a forward shows
    which names were used, so :meth:`check_names` runs once one has (the Lightning
    callback after its first step; :func:`apply_config` at the first backward).
    """

    plan: WrapPlan
    names: list[str]
    names_policy: Any = None  # the selective policy that goes by checkpoint_name tags, until checked

    def check_names(self) -> None:
        """Raise, naming them, for the policy's names no ``checkpoint_name`` used; once."""
        policy, self.names_policy = self.names_policy, None
        if policy is not None:
            policy.check_names()


def install_plan(model: nn.Module, plan: WrapPlan) -> Installation:
    """Put ``plan`` on ``model`` (replacing what the plugin had put there) and say what was installed."""
    names = install(model, plan)
    policy = policy_of(user_module(model))
    return Installation(plan, names, policy if policy is not None and policy.uses_names else None)


def apply_config(model: nn.Module, config: CkptConfig, forward: Callable[[], Any] | None = None) -> list[str]:
    """Plan ``config`` on ``model`` and install the plan; returns the qualified names wrapped.

    The plan's summary goes to the ``ckpt_plugin`` logger. With ``ckpt.policy=names``
    the names are checked as the first backward starts (:class:`Installation`).
    """
    plan = plan_for(model, config, forward)
    installed = install_plan(model, plan)
    if plan.summary:
        log.info(plan.summary)
    if installed.names_policy is not None:
        installed.names_policy.check_names_when_recomputing()  # nothing on the model: remove leaves it as it was
    if forward is None and getattr(user_module(model), "example_input_array", None) is not None:
        forward = example_forward(user_module(model))
    if forward is not None:
        warn_overkeep(model, config, installed.names, forward)
    return installed.names


def warn_overkeep(model: nn.Module, config: CkptConfig, names: list[str], forward: Callable[[], Any],
                  warn: Callable[[str], Any] | None = None) -> None:
    """A ``UserWarning`` naming each layer a fixed mode (every mode but none and auto) makes keep more for backward
    than no checkpointing keeps there (``measure/overkeep.py``: two forwards on fake tensors). ``warn``: how it is
    said (the callback: Lightning's rank-zero warning); default ``warnings.warn``."""
    if isinstance(config, (NoneConfig, AutoConfig)) or not names:
        return
    try:
        rows = over_kept(model, names, forward)
    except NotFakeable as err:  # measured on fake tensors or not at all: never a real step
        log.info("ckpt_plugin: the over-keeping check was skipped: %s", err)
        return
    if rows and warn is not None:
        warn(overkeep_warning(rows, f"ckpt={config.mode}"))
    elif rows:
        warnings.warn(overkeep_warning(rows, f"ckpt={config.mode}"), UserWarning, stacklevel=3)


def apply_checkpointing(model: nn.Module, *, step: Callable[[], Any] | None = None, **ckpt_keys: Any) -> list[str]:
    """Checkpoint the layers of ``model`` named by the keys of the ``ckpt`` node.

    >>> apply_checkpointing(gpt, layers="TransformerBlock")
    ['blocks.0', 'blocks.1', ...]
    >>> apply_checkpointing(net, mode="auto", layers="Block", budget=0.5, step=lambda: loss_fn(net(x), y))

    Returns the qualified names wrapped, in model order. Applying again replaces
    the previous wrapping (never wraps twice); ``mode="none"`` unwraps.
    ``step``: the training step to plan for and report on, a callable returning the loss (its loss and
    whatever it computes beside the model included; run on fake tensors, what it does to the model's
    attributes and the random streams put back: ``measure/contained.py``); by default the model's forward on
    its ``example_input_array``, its output summed.
    ``mode="auto", plan="ckpt_plan.json"`` installs a saved plan (``planning/plan_file.py``)
    without planning; ``planning.plan_file.save_plan(plan_for(...), path, model)`` writes one.
    """
    if step is not None and not callable(step):
        raise TypeError(f"apply_checkpointing(step=...) takes a callable that runs the training step and returns "
                        f"its loss, not {type(step).__name__}")
    return apply_config(model, make_config(**ckpt_keys), None if step is None else contained_step(model, step))


def contained_step(model: nn.Module, step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` as measurements run it: what it does to ``model``'s attributes and the random streams put back."""
    def run() -> Any:
        with contained(model):
            return step()

    return run


__all__ = ["Installation", "apply_checkpointing", "apply_config", "contained_step", "install_plan", "warn_overkeep"]

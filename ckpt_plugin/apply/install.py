"""The spine: a model and a ``ckpt`` config in, the plan installed (``config -> plan -> install``).

    apply_checkpointing(model, layers="TransformerBlock")     # the keys of the ckpt node
    apply_config(model, make_config(...), forward)            # a config already built

Every surface (the torch API, the Lightning callback, Fabric, LightningCLI,
``ckpt-inspect``) comes through :func:`plan_for` and the engine's ``install``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from ckpt_plugin._compat import user_module
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import CkptConfig, make_config
from ckpt_plugin.engine.wrap import install, policy_of

log = logging.getLogger("ckpt_plugin")


def apply_config(model: nn.Module, config: CkptConfig, forward: Callable[[], Any] | None = None) -> list[str]:
    """Plan ``config`` on ``model`` and install the plan; returns the qualified names wrapped.

    With ``ckpt.policy=names``, the first backward checks the names, as the
    Lightning callback does after its first step and ``checkpoint()`` after its
    first call: a name in ``ckpt.save_names``/``exclude_names`` that no
    ``checkpoint_name`` used would otherwise save nothing, silently.
    """
    plan = plan_for(model, config, forward)
    names = install(model, plan)
    if plan.summary:
        log.info(plan.summary)
    policy = policy_of(user_module(model))
    if policy is not None and policy.uses_names:
        policy.check_in_backward = True  # nothing on the model: remove_checkpointing leaves it as it was
    return names


def apply_checkpointing(model: nn.Module, **ckpt_keys: Any) -> list[str]:
    """Checkpoint the layers of ``model`` named by the keys of the ``ckpt`` node.

    >>> apply_checkpointing(gpt, layers="TransformerBlock")
    ['blocks.0', 'blocks.1', ...]

    Returns the qualified names wrapped, in model order. Applying again replaces
    the previous wrapping (never wraps twice); ``mode="none"`` unwraps.
    ``mode="auto", plan="ckpt_plan.json"`` installs a saved plan (``planning/plan_file.py``)
    without planning; ``planning.plan_file.save_plan(plan_for(...), path, model)`` writes one.
    """
    return apply_config(model, make_config(**ckpt_keys))


__all__ = ["apply_checkpointing", "apply_config"]

"""``checkpoint``: JAX's ``jax.checkpoint`` for PyTorch functions that are not modules.

    from ckpt_plugin import checkpoint, checkpoint_name

    loss = checkpoint(model.loss)(batch)                      # recompute everything
    loss = checkpoint(model.loss, policy="matmuls")(batch)    # save matmul outputs, recompute the rest

    @checkpoint(policy="names", save_names=["h"])
    def layer(W, x):
        h = checkpoint_name(torch.sin(x @ W), "h")
        return torch.cos(h)

Every call runs ``fn`` under non-reentrant ``torch.utils.checkpoint``; with a
policy, under its selective contexts (``selective/policies.py``). For a module, prefer
``apply_checkpointing``: it also keeps BatchNorm running statistics from being
updated twice by the recomputation, which a plain function cannot know about.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ckpt_plugin._compat import non_reentrant_checkpoint
from ckpt_plugin.engine.selective.policies import SelectivePolicy, make_policy


def checkpoint(
    fn: Callable[..., Any] | None = None,
    *,
    policy: Any = None,
    save_names: Any = None,
    exclude_names: Any = None,
    preserve_rng_state: bool = True,
    offload: bool = False,
) -> Any:
    """Return ``fn`` rematerialised: its activations are recomputed in backward, not kept.

    - ``policy``: None recomputes everything; ``"matmuls"``, ``"matmuls_no_batch"``,
      ``"names"`` or a list of aten op names saves those outputs (see :func:`make_policy`);
    - ``save_names`` / ``exclude_names``: with ``policy="names"``, the
      :func:`checkpoint_name` tags to save, or to recompute while saving every other;
      a name no call has used is an error after the first call that records gradients;
    - ``preserve_rng_state``: replay the RNG on recompute, so dropout matches;
    - ``offload``: keep what is still saved (the inputs, the policy's outputs) in CPU memory.

    ``checkpoint(fn, ...)`` and ``@checkpoint`` / ``@checkpoint(policy=...)`` all work.
    """
    if fn is None:
        if policy is not None or save_names is not None or exclude_names is not None:
            make_policy(policy, save_names=save_names, exclude_names=exclude_names)  # fail at the decorator
        return functools.partial(
            checkpoint,
            policy=policy,
            save_names=save_names,
            exclude_names=exclude_names,
            preserve_rng_state=preserve_rng_state,
            offload=offload,
        )
    if not callable(fn):
        raise TypeError(f"checkpoint expects a function to transform, got {type(fn).__name__}")
    for key, value in (("preserve_rng_state", preserve_rng_state), ("offload", offload)):
        if not isinstance(value, bool):
            raise ValueError(f"ckpt.{key}={value!r} ({type(value).__name__}) must be true or false")
    selective: SelectivePolicy | None = None
    if policy is not None or save_names is not None or exclude_names is not None:
        selective = make_policy(policy, save_names=save_names, exclude_names=exclude_names)
    options: dict[str, Any] = {"preserve_rng_state": preserve_rng_state}
    if selective is not None:
        options["context_fn"] = selective.context_fn

    offloaded = _offloading() if offload else contextlib.nullcontext

    @functools.wraps(fn)
    def rematerialised(*args: Any, **kwargs: Any) -> Any:
        # kwargs travel in a partial: an argument of fn can never collide with
        # checkpoint's own keywords (context_fn, use_reentrant, ...).
        call = functools.partial(fn, **kwargs) if kwargs else fn
        recording = torch.is_grad_enabled()  # without grad, checkpoint runs fn plainly
        with offloaded():
            out = non_reentrant_checkpoint(call, *args, **options)
        if selective is not None and selective.uses_names and recording:
            selective.check_names()
        return out

    return rematerialised


def _offloading() -> Callable[[], contextlib.AbstractContextManager]:
    """A fresh offloading context per call of one transform, all saying "nothing to move" at most once and sharing
    one host pool."""
    from ckpt_plugin.engine.offload import NothingToMoveNotice, offloading  # imported on use: offloading is optional
    from ckpt_plugin.engine.offload_copies import Offloader

    notice, offloader = NothingToMoveNotice(), Offloader()  # one host pool for the transform's calls
    return lambda: offloading(notice=notice, offloader=offloader, per_tensor=False)  # a call: one region's inputs


__all__ = ["checkpoint"]

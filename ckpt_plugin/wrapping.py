"""Wrap and unwrap modules with non-reentrant activation checkpointing.

A selected module keeps its place, its class and its name: we set an
instance-level ``forward`` that runs the class's own forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. ``nn.Module``
looks ``forward`` up on the instance first, so hooks, ``state_dict`` keys and
``named_parameters`` stay exactly as they were, unlike torch's
``checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module`` into every
key (pytorch#117399, pytorch#108269). Removing the attribute restores the
module exactly.

Recomputation replays the forward, and a BatchNorm in training mode would
update its running statistics a second time (pytorch#96136, open upstream).
The recompute context below snapshots every running-statistics buffer in the
wrapped subtree and writes it back afterwards, so statistics match a run
without checkpointing bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import CkptConfig, make_config
from .selection import select_layers

# Buffers that a forward in training mode updates in place (BatchNorm,
# InstanceNorm with track_running_stats, SyncBatchNorm, and look-alikes).
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _running_stats(module: nn.Module) -> list[tuple[nn.Module, str]]:
    return [
        (m, name)
        for m in module.modules()
        for name in _RUNNING_STATS
        if isinstance(getattr(m, name, None), torch.Tensor)
    ]


@contextlib.contextmanager
def _keep_running_stats(stats: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Undo whatever the recomputation writes into running-statistics buffers."""
    saved = [(m, name, getattr(m, name).clone()) for m, name in stats if m.training]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, value in saved:
                getattr(m, name).copy_(value)


class CheckpointedForward:
    """The instance-level ``forward`` of a wrapped module.

    ``inner`` is the forward the module had before (its class's, or an
    instance-level one somebody else set, which ``remove`` puts back).
    """

    __slots__ = ("inner", "previous", "preserve_rng_state", "_stats")

    def __init__(self, module: nn.Module, preserve_rng_state: bool) -> None:
        self.previous = module.__dict__.get("forward")  # None: the class's forward
        self.inner: Callable[..., Any] = module.forward
        self.preserve_rng_state = preserve_rng_state
        self._stats = _running_stats(module)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _keep_running_stats(self._stats)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # kwargs travel in a partial so that a forward argument can never
        # collide with checkpoint's own keywords (``context_fn``, ...).
        fn = functools.partial(self.inner, **kwargs) if kwargs else self.inner
        options: dict[str, Any] = {}
        if self._stats:
            options["context_fn"] = self._contexts
        return checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **options
        )


def wrapped_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that this plugin has wrapped."""
    return [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo :func:`apply_checkpointing`: every wrapped module gets its forward back.

    Returns the qualified names that were unwrapped. Safe on a model that was
    never wrapped.
    """
    removed = []
    for name, module in model.named_modules():
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, CheckpointedForward):
            if wrapper.previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = wrapper.previous
            removed.append(name)
    return removed


def apply_config(model: nn.Module, config: CkptConfig) -> list[str]:
    """Wrap the modules ``config`` selects; see :func:`apply_checkpointing`."""
    if config.mode == "none":
        remove_checkpointing(model)
        return []
    # Check everything against the model before touching it: an error leaves
    # the model exactly as it was (wrapped or not).
    names = select_layers(model, config)
    remove_checkpointing(model)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        module.__dict__["forward"] = CheckpointedForward(module, config.preserve_rng_state)
    return names


def apply_checkpointing(model: nn.Module, **ckpt_keys: Any) -> list[str]:
    """Checkpoint the layers of ``model`` named by the keys of the ``ckpt`` node.

    >>> apply_checkpointing(gpt, layers="TransformerBlock")
    ['blocks.0', 'blocks.1', ...]

    Returns the qualified names wrapped, in model order. Applying again replaces
    the previous wrapping (never wraps twice); ``mode="none"`` unwraps.
    """
    return apply_config(model, make_config(**ckpt_keys))


@contextlib.contextmanager
def checkpointing_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as if it were not wrapped, then put the very same wrappers back."""
    wrappers = {
        m: m.__dict__["forward"]
        for m in model.modules()
        if isinstance(m.__dict__.get("forward"), CheckpointedForward)
    }
    remove_checkpointing(model)
    try:
        yield
    finally:
        for m, wrapper in wrappers.items():
            m.__dict__["forward"] = wrapper

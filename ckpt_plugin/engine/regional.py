"""``ckpt.compile``: each wrapped layer's call runs compiled, its checkpoint included (regional compilation).

What is compiled is the checkpointed call itself, ``checkpoint(layer.forward, *args)``,
as torchtitan compiles each block after wrapping it for activation checkpointing:
dynamo captures the checkpoint as one higher-order op and AOTAutograd's
partitioner puts the recomputation into the layer's compiled backward, where the
backend (inductor) fuses it with the gradient kernels. The rest of the model
stays eager: no whole-model compile, no graph break outside the layers.

Nothing is inserted into the model: the compiled function is called from the
layer's instance-level ``forward`` (``wrap.CheckpointedForward``), so names,
hooks and ``state_dict`` keys are the layer's own, and ``remove_checkpointing``
deleting that ``forward`` leaves no compiled code on the module.

One function for every layer: dynamo caches compiled code per *code object* and
guards on what it read, so every layer of one structure (the 12 blocks of a GPT)
shares one graph, compiled on the first block's first call; another structure,
input shape, train or eval mode compiles once more. All of them are graphs of one
code object, which torch limits to ``torch._dynamo.config.recompile_limit`` (8)
graphs: a ResNet's stages (a first block with a strided shortcut, then plain
ones, per stage) in training and in eval reach it. So the limit of these calls is
two graphs per compiled layer (each its own, in training and in eval), or torch's
if that is higher; past it, input shapes keep changing, which is what the limit
is for.

``fullgraph=True``, as torchtitan does: a layer that dynamo cannot capture whole
would otherwise run its checkpoint eagerly inside the compiled frame, with no
compiled recomputation, and with none of the eager contexts that keep
BatchNorm statistics once (those are left out of the compiled call on purpose:
per layer they would be constants in the graph, and every layer would compile
again). So the first call of such a layer, or one compile past the recompile
limit, raises a :class:`~ckpt_plugin.errors.ConfigError` naming the layer and
``ckpt.compile``, never a silent eager fallback.

Under an outer ``torch.compile(model)``, dynamo inlines these calls into the
model's graph (nested compilation: one graph, the same gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ckpt_plugin._compat import (
    compile_failures,
    compile_with_recompile_limit,
    non_reentrant_checkpoint,
    recompile_limit,
    recompile_limit_hit,
)
from ckpt_plugin.errors import ConfigError, Problem


def _checkpointed(fn: Callable[..., Any], preserve_rng_state: bool, context_fn: Any, args: tuple, kwargs: dict) -> Any:
    """The call that is compiled: the layer's forward under non-reentrant checkpoint.

    kwargs travel in a partial so that a forward argument can never collide with
    checkpoint's own keywords; it is made here, inside the compiled frame, so that
    tensors among them are graph inputs, not constants of the graph.
    """
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    options = {"context_fn": context_fn} if context_fn is not None else {}
    return non_reentrant_checkpoint(fn, *args, preserve_rng_state=preserve_rng_state, **options)


def _uncheckpointed(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The call that is compiled for a layer that is not checkpointed (``ckpt=offload``, compiled)."""
    return fn(*args, **kwargs)


class CompiledCalls:
    """The compiled calls of the layers that share one treatment in one installation.

    ``context_fn`` is the treatment's without per-layer state (no BatchNorm
    statistics, no label): compiled, only its policy matters (torch's selective
    modes decide with it, ``treatment.py``), and one object for every layer keeps
    dynamo from compiling each layer again for a constant of its own. None for
    full checkpointing: torch.compile then recomputes every op, as with a plain
    ``checkpoint`` call.
    """

    def __init__(self, backend: str, treatment: Any, layers: int) -> None:
        self.backend = backend
        self.treatment = treatment
        self.context_fn = treatment.context_fn([]) if treatment.checkpointing else None
        self.layers = layers
        self.recompile_limit = max(recompile_limit(), 2 * layers)
        self._checkpointed = compile_with_recompile_limit(_checkpointed, backend, True, self.recompile_limit)
        self._uncheckpointed = compile_with_recompile_limit(_uncheckpointed, backend, True, self.recompile_limit)

    def checkpointed(self, fn: Callable[..., Any], args: tuple, kwargs: dict, label: str) -> Any:
        try:
            return self._checkpointed(fn, self.treatment.preserve_rng_state, self.context_fn, args, kwargs)
        except compile_failures() as err:
            raise self._error(err, label) from err

    def uncheckpointed(self, fn: Callable[..., Any], args: tuple, kwargs: dict, label: str) -> Any:
        try:
            return self._uncheckpointed(fn, args, kwargs)
        except compile_failures() as err:
            raise self._error(err, label) from err

    def _error(self, err: Exception, label: str) -> ConfigError:
        key = f"ckpt.compile ({self.backend})"
        if recompile_limit_hit(err):
            return ConfigError([Problem(
                "ckpt.compile",
                f"{key}: compiling {label} once more would pass the recompile limit of the {self.layers} compiled "
                f"layer(s), {self.recompile_limit} graphs (two per layer, for training and eval, or "
                "torch._dynamo.config.recompile_limit if higher): their input shapes keep changing",
                "mark the changing dimension dynamic (torch._dynamo.mark_dynamic), raise "
                "torch._dynamo.config.recompile_limit before applying, or set ckpt.compile=false",
            )])
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        return ConfigError([Problem(
            "ckpt.compile",
            f"{key}: {label} does not compile as one graph with its checkpoint (torch.compile(fullgraph=True) "
            f"over its checkpointed forward): {reason}",
            "change that part of its forward (TORCH_LOGS=graph_breaks shows where), select layers that compile "
            "whole, or set ckpt.compile=false",
        )])


__all__ = ["CompiledCalls"]

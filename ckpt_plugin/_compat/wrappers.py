"""The user's own module inside the wrappers a training setup puts around it (``torch.compile``, DDP,
DataParallel, FSDP (v1), Lightning Fabric: private attributes each), for selection.py and wrap.py; and torch's
``CheckpointWrapper``."""

from __future__ import annotations

import sys
from typing import Any

import torch


def checkpoint_wrapper_type() -> type:
    """torch's ``CheckpointWrapper`` (what FSDP's activation_checkpointing_policy inserts)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # private module

    return CheckpointWrapper


def _inner(model: Any) -> Any:
    """The module one wrapper layer holds, or None when ``model`` is no wrapper we know."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod  # torch.compile: private attribute, no public getter
    # Lightning Fabric's ``fabric.setup(model)``, detected without importing Lightning:
    # ``_FabricModule._original_module`` (private to Lightning) is the module the user passed,
    # while ``_forward_module`` may be the strategy's wrapper (DDP, FSDP) around it.
    original = getattr(model, "_original_module", None) if type(model).__name__ == "_FabricModule" else None
    if isinstance(original, torch.nn.Module):
        return original
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module  # public
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")  # FSDP (v1), if in use
    if fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel):
        return model.module  # public property: the root's ``_fsdp_wrapped_module``
    return None


def user_module(model: Any) -> Any:
    """The module the user built, inside any ``torch.compile``, DDP, DataParallel, FSDP (v1)
    or Lightning Fabric wrapper, nested in any order; ``model`` itself if it is none of those.

    Its names are the user's own (``blocks.0``, not ``_forward_module.module.blocks.0``),
    and its modules are the very ones the wrappers run, so wrapping them is what
    training runs (dynamo guards on each module's ``forward``: a change after a
    compiled run recompiles). Inner FSDP (v1) units keep torch's
    ``_fsdp_wrapped_module`` in their names: they are modules of the model now.
    """
    while (inner := _inner(model)) is not None:
        model = inner
    return model


def compiled_by_user(model: Any, names: list[str]) -> bool:
    """Whether the step runs the layers ``names`` (of ``user_module(model)``) compiled by the user's own
    ``torch.compile``: ``model`` or a wrapper in it is compiled, Lightning compiled the LightningModule
    (``trainer.fit(torch.compile(model))`` keeps the compile in ``_compiler_ctx``, private to
    Lightning), or a layer or one of its parents was compiled in place (``Module.compile()`` sets the
    private ``_compiled_call_impl``) or replaced by a compiled module."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # not imported: nothing was compiled
        return False
    while model is not None:
        if isinstance(model, eval_frame.OptimizedModule) or getattr(model, "_compiler_ctx", None) is not None:
            return True
        root, model = model, _inner(model)
    modules = dict(root.named_modules())
    for name in names:
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            module = modules.get(".".join(parts[:depth]))
            if isinstance(module, eval_frame.OptimizedModule) or getattr(module, "_compiled_call_impl", None):
                return True
    return False


def uncompiled(model: Any) -> Any:
    """Former name of :func:`user_module` (which also looks through DDP, FSDP and Fabric)."""
    return user_module(model)

"""Counting hooks and modes in force (``ckpt_tools/soak.py``'s leak counters), and the global module hooks
(public, documented under ``torch.nn.modules.module``, an internal path)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.nn.modules.module import (  # public (documented under this path), kept here with the other internals
    register_module_forward_hook,
    register_module_forward_pre_hook,
)


def _hook_dicts_size(namespace: dict[str, Any], prefix: str) -> int:
    # Every hook dict (``_forward_hooks``, ...), not the flag dicts ``_forward_hooks_with_kwargs``
    # and ``_forward_hooks_always_called``, which are keyed by the same hooks.
    return sum(len(v) for k, v in namespace.items() if k.startswith(prefix) and k.endswith("hooks")
               and isinstance(v, dict))


_TENSOR_HOOK_ATTRIBUTES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def hook_count(obj: Any) -> int:
    """Hooks registered on one module, optimizer or tensor.

    torch has no public way to list them: they live in private attributes
    (``module._forward_hooks``, ``optimizer._optimizer_step_pre_hooks``, ...;
    for a tensor ``_backward_hooks`` and ``_post_accumulate_grad_hooks``, C-level
    attributes not in ``__dict__``). ckpt-soak counts them to catch leaked hooks.
    """
    if isinstance(obj, torch.Tensor):
        return sum(len(getattr(obj, a, None) or ()) for a in _TENSOR_HOOK_ATTRIBUTES)
    return _hook_dicts_size(vars(obj), prefix="_")


def global_hook_count() -> int:
    """Hooks in torch's process-wide module and optimizer registries.

    ``register_module_forward_hook`` and friends and ``register_optimizer_step_pre_hook``
    file them in the private module globals ``torch.nn.modules.module._global_*hooks``
    and ``torch.optim.optimizer._global_*hooks``; ckpt-soak counts them to catch leaks
    (``saved_activations`` registers global module hooks for one forward).
    """
    # By name: ``torch.optim`` deletes its ``optimizer`` submodule attribute.
    return sum(_hook_dicts_size(vars(importlib.import_module(table)), prefix="_global_")
               for table in ("torch.nn.modules.module", "torch.optim.optimizer"))


def saved_tensors_hooks_depth() -> int:
    """How many ``saved_tensors_hooks`` are in force (ckpt-soak: none may be left after a step).

    torch has only a private getter for the top of the stack
    (``torch._C._autograd._top_saved_tensors_default_hooks``): pop them all, count, push them back.
    """
    autograd = torch._C._autograd
    popped = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(popped):
        autograd._push_saved_tensors_default_hooks(pack, unpack)
    return len(popped)


def mode_stack_depth() -> int:
    """Dispatch modes plus function modes in force (ckpt-soak: none may be left after a step).

    Private counters (``torch._C._len_torch_dispatch_stack``, ``_len_torch_function_stack``), no public ones.
    """
    return torch._C._len_torch_dispatch_stack() + torch._C._len_torch_function_stack()

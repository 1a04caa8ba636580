"""Ops as the dispatcher sees them: the dispatch-mode base class, an op's schema (what it writes, its
arguments) and the FLOPs ``FlopCounterMode`` counts for it."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # documented, but in a private module


def beneath_dispatch_modes() -> Any:
    """A context in which no Python dispatch mode sees the ops run (``_disable_current_modes``, private): for
    the offloader's host-side work (a pool region, the copy into it), which is no op of the model and no device
    memory, so that MemTracker, FLOP counters and selective policies count the model's ops only."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The FLOPs ``FlopCounterMode`` counts for one op that ran (``out``), without running it again.

    Its registry (``torch.utils.flop_counter.flop_registry``) counts matmuls, convolutions and
    attention by shape. An op it has no formula for, FlopCounterMode runs decomposed
    (``OpOverload.decompose``, CompositeImplicitAutograd) and counts the parts: here the
    decomposition runs on the side, under a FlopCounterMode of its own, only for such ops.
    """
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    count = flop_registry.get(func._overloadpacket)
    if count is not None:
        return count(*args, **kwargs, out_val=out)
    if not _decomposes(func):
        return 0
    with FlopCounterMode(display=False) as counter:
        func.decompose(*args, **kwargs)
    return counter.get_total_flops()


@functools.cache
def _decomposes(func: Any) -> bool:
    """``func`` is an op FlopCounterMode would decompose: a CompositeImplicitAutograd kernel or a Python one."""
    if isinstance(func, torch._ops.HigherOrderOperator) or func is torch.ops.prim.device.default:
        return False
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in getattr(func, "py_kernels", {}) or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


def is_mutable(op: Any) -> bool:
    """In-place and ``out=`` overloads write into an argument."""
    return op._schema.is_mutable


@functools.cache
def _written_arguments(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op`` writes into; () for a functional op. Read once per op: a
    selective region asks it of every op it runs."""
    if not op._schema.is_mutable:
        return ()
    return tuple((i, arg.name) for i, arg in enumerate(op._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def written(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors one call of ``op`` writes into (its schema's ``Tensor(a!)`` arguments: ``self`` of an in-place
    op, ``out=``); [] for a functional op."""
    found = []
    for i, name in _written_arguments(op):
        value = args[i] if i < len(args) else kwargs.get(name)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in values if isinstance(t, torch.Tensor)]
    return found


def argument(op: Any, args: tuple, kwargs: dict, name: str, missing: Any = None) -> Any:
    """Argument ``name`` of one call of ``op`` (its schema default if not passed; ``missing`` if none)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name, arg.default_value)
    return missing

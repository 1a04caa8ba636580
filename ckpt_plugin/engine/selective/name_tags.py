"""``checkpoint_name``: tag a tensor so that a ``policy="names"`` region saves or recomputes it by name.

JAX's ``checkpoint_name``. A tag is a custom op (``torch.ops.ckpt_plugin.checkpoint_name``) that
the region's dispatch modes see (``selective_modes.py``) and the policy decides on
(``policies.SelectivePolicy.saves``); outside such a region the tag is no op at all.
"""

from __future__ import annotations

import contextvars

import torch


# Not "ckpt_plugin::name": torch.ops.<namespace>.name is the namespace's own name string.
@torch.library.custom_op("ckpt_plugin::checkpoint_name", mutates_args=())
def _name(x: torch.Tensor, name: str) -> torch.Tensor:
    # A copy: a custom op may not return its input. The copy is what gets saved.
    return x.clone()


@_name.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


_name.register_autograd(lambda ctx, grad: (grad, None))
NAME_OP = torch.ops.ckpt_plugin.checkpoint_name.default

# True while a region whose policy goes by names runs its forward or its recomputation.
# This is not hidden global state: like grad mode or autocast, the value is scoped to the
# dynamic extent of one region (set on entry, reset by token on exit), per thread and
# per async context, so it never outlives the region nor leaks into another model.
NAMING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_plugin_naming", default=False)


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Tag ``x`` so that a ``policy="names"`` region can save or recompute it by ``name``.

    JAX's ``checkpoint_name``. Outside such a region it returns ``x`` itself:
    no op and no copy, so tagged model code costs nothing when not checkpointed.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"checkpoint_name expects a tensor, got {type(x).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint_name: the name must be a non-empty string, got {name!r}")
    if torch.compiler.is_compiling():
        # Dynamo cannot trace ContextVar.get (a graph break per tag). Compiled, tags are inert:
        # a names region refuses torch.compile (treatment.NAMES_UNDER_COMPILE).
        return x
    return NAME_OP(x, name) if NAMING.get() else x


__all__ = ["NAME_OP", "NAMING", "checkpoint_name"]

"""torch's private generator behind a non-reentrant checkpoint region, its signature checked, and its end.

Below both ``checkpoint.py`` (which runs a region itself on torch 2.11 and 2.12) and ``regions.py`` (regions
that span several layers' calls): neither imports the other for it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

# The parameters of ``_checkpoint_without_reentrant_generator`` before its ``*args`` (torch 2.11 to 2.15:
# ``fn, preserve_rng_state=True, context_fn=noop_context_fn, determinism_check="default",
# debug=False, early_stop=True, *args, **kwargs``, 2.14 and 2.15 with a keyword-only parameter more).
_REGION_PARAMETERS = ("fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


@functools.cache
def _region_generator() -> Any:
    """torch's private region generator, once its signature is checked to be the one we call.

    :func:`open_region` must pass the named parameters positionally (see there); a torch
    that renamed, reordered, added or dropped one would otherwise take our values for the
    wrong parameters without a word, so it fails here instead.
    """
    from torch.utils.checkpoint import _checkpoint_without_reentrant_generator  # private

    params = list(inspect.signature(_checkpoint_without_reentrant_generator).parameters.values())
    named = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # Keyword-only parameters with a default may follow ``*args``: we leave them at it. torch 2.14 and 2.15
    # have ``respect_saved_tensors_hooks=None`` there (whether torch's own selective checkpoint routes what it
    # saves through the caller's saved_tensors_hooks; None: as before), 2.11 to 2.13 have none.
    kinds = [p.kind for p in params if not (p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty)]
    expected_kinds = [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(_REGION_PARAMETERS) + [
        inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    if named != _REGION_PARAMETERS or kinds != expected_kinds:
        raise RuntimeError(
            "torch.utils.checkpoint._checkpoint_without_reentrant_generator changed its signature to "
            f"{inspect.signature(_checkpoint_without_reentrant_generator)}; ckpt_plugin._compat.open_region "
            f"expects ({', '.join(_REGION_PARAMETERS)}, *args, **kwargs) and needs updating for this torch"
        )
    return _checkpoint_without_reentrant_generator


def close_region(gen: Any) -> None:
    """End a region :func:`open_region` started (its generator must finish on this step)."""
    try:
        next(gen)
    except StopIteration:
        return
    raise AssertionError("a checkpoint region generator yielded twice")


__all__ = ["_region_generator", "close_region"]

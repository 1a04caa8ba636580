"""torch's pytree (``torch.utils._pytree``): a private module with a stable API."""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves  # pytree: private module, stable API


# -- for timing a layer on fresh leaves made from its real inputs (planning/timing.py) --

def tree_map(fn: Any, tree: Any) -> Any:
    """``tree`` (nested tuples, lists, dicts) with every leaf replaced by ``fn(leaf)``.

    ``torch.utils._pytree.tree_map``: a private module with a stable API, as ``tree_leaves``.
    """
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(fn, tree)

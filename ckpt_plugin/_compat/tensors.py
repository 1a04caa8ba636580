"""What autograd knows of a tensor and has no public getter for: its storage's identity, its in-place write
counter, the tensor it is a view of, and the saved-tensor hooks in force around it."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef  # what torch.utils.checkpoint keys storages by

from ckpt_plugin._compat.fake import is_fake


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage, shared by views (``untyped_storage`` is public)."""
    try:
        st = t.untyped_storage()
        if is_fake(t):  # no data pointer; torch keeps one Python object per live storage
            return (str(t.device), id(st))
        ptr = st.data_ptr()
    except (NotImplementedError, RuntimeError):  # wrapper subclasses (FSDP2's DTensor parameters) have none
        return (str(t.device), id(t))
    return (str(t.device), ptr) if ptr else (str(t.device), id(st))


# -- for selective checkpointing's dispatch modes (engine/selective/) --

def outer_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair of the innermost ``saved_tensors_hooks``, or None (no public getter)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def version(t: torch.Tensor) -> int:
    """The in-place write counter autograd checks saved tensors against (``Tensor._version``,
    private, no public getter; engine/selective/ and engine/offload.py key cached tensors by it)."""
    return t._version


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None (``Tensor._base``: semi-public, undocumented).

    measure/memory.py and engine/offload.py use it to treat a view of a parameter
    (``weight.t()`` saved by a matmul) as the parameter.
    """
    return t._base

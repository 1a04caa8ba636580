"""The one place that touches private or moving torch APIs.

Every private torch name the package and its tools use is reached through
this file (``tests/test_compat.py`` has a test per shim, and a test that no
other file imports a private torch module). If a torch release moves one of
these, this file is the only one to change. Tested on the torch the project
declares (``pyproject.toml``).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch.distributed._tools.mem_tracker import MemTracker  # private: torch._tools
from torch.multiprocessing.reductions import StorageWeakRef  # what torch.utils.checkpoint keys storages by
from torch.utils._python_dispatch import TorchDispatchMode  # documented, but in a private module
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves  # pytree: private module, stable API


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage, shared by views (``untyped_storage`` is public)."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
    except (NotImplementedError, RuntimeError):  # wrapper subclasses (FSDP2's DTensor parameters) have none
        return (str(t.device), id(t))
    return (str(t.device), ptr) if ptr else (str(t.device), id(st))


class CategoryPeakTracker(MemTracker):
    """``MemTracker`` that also records each category's own peak over the step.

    MemTracker's ``get_tracker_snapshot("peak")`` gives the split at the moment
    the *total* peaked; the activation peak is usually earlier (end of forward)
    than the total peak (gradients alive), so we keep the per-category maxima
    from the same live snapshot MemTracker updates after every op.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.category_peaks: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # MemTracker files what backward makes as temporaries, except inside a recomputation
        # that a module's own forward hooks announce (``_in_ac``): the recompute of a module
        # wrapped by an instance-level forward, or of a plain function, would land in TEMP
        # op by op, between the hooks of its submodules. In backward, autograd runs its nodes
        # with grad mode off (unless create_graph), and checkpoint re-enables it for the
        # recomputation: so a grad-enabled op in backward is a recomputed activation.
        if not self._in_ac and torch.is_grad_enabled() and self._mod_tracker.is_bw:
            self._in_ac = True
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_ac = False
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:  # private hook of MemTracker
        super()._update_peak_stats(peak_state)
        for dev_snap in self._curr_mem_snap.values():
            for key, value in dev_snap.items():
                name = getattr(key, "name", str(key)).lower()
                if value > self.category_peaks.get(name, 0):
                    self.category_peaks[name] = value


def open_region(fn: Any, preserve_rng_state: bool, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Start a non-reentrant checkpoint region that later code (not one call) runs inside.

    torch's composable ``checkpoint`` opens its region in a forward pre-hook and
    closes it in a forward hook with this private generator; we do the same
    for regions spanning several layers. ``fn(*args, **kwargs)`` is what
    recomputation runs. Close with :func:`close_region` (or ``gen.close()`` on error).
    """
    from torch.utils.checkpoint import _checkpoint_without_reentrant_generator  # private

    gen = _checkpoint_without_reentrant_generator(
        fn, preserve_rng_state, context_fn, "default", False, True, *args, **kwargs
    )
    next(gen)
    return gen


def close_region(gen: Any) -> None:
    try:
        next(gen)
    except StopIteration:
        return
    raise AssertionError("a checkpoint region generator yielded twice")


def checkpoint_wrapper_type() -> type:
    """torch's ``CheckpointWrapper`` (what FSDP's activation_checkpointing_policy inserts)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # private module

    return CheckpointWrapper


# -- for checkpoint under torch.compile (treatment.py, wrapping.py) --

def uncompiled(model: Any) -> Any:
    """The module ``torch.compile(model)`` wraps (``OptimizedModule._orig_mod``), else ``model``.

    Its names are the model's own (no ``_orig_mod.`` prefix), and wrapping its
    modules is what the compiled module runs: dynamo guards on each module's
    ``forward``, so a change after a compiled run recompiles.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def tracing_for_compile() -> bool:
    """Whether AOTAutograd is tracing right now (torch.compile, export), as torch's checkpoint
    itself decides it (``torch.utils.checkpoint._is_compiling``: a proxy dispatch mode is
    active); it then accepts only torch's own selective-checkpoint modes from ``context_fn``."""
    if torch.compiler._is_non_strict_tracing():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def checkpoint_debug_enabled() -> bool:
    """Whether ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` is in force (no getter)."""
    return bool(torch.utils.checkpoint._checkpoint_debug_enabled)


# -- for selective checkpointing's dispatch modes (policies.py) --

def outer_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair of the innermost ``saved_tensors_hooks``, or None (no public getter)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def version(t: torch.Tensor) -> int:
    """The in-place write counter autograd checks saved tensors against."""
    return t._version


def is_mutable(op: Any) -> bool:
    """In-place and ``out=`` overloads write into an argument."""
    return op._schema.is_mutable


def argument(op: Any, args: tuple, kwargs: dict, name: str, missing: Any = None) -> Any:
    """Argument ``name`` of one call of ``op`` (its schema default if not passed; ``missing`` if none)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name, arg.default_value)
    return missing


# -- for saved_activations' row sources (residuals.py) --

_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def checkpointed_fn(frame: FrameType | None) -> Any:
    """The ``fn`` of the non-reentrant checkpoint that is saving its inputs right now, or None.

    torch saves a region's inputs from inside ``_checkpoint_without_reentrant_generator``
    (``_CheckpointFrame.save_inputs`` in torch 2.13, ``NoopSaveInputs`` in older
    releases), which is on the call stack only then: while the region runs, the
    generator is suspended at its ``yield``. Private torch internals: if they
    move, those rows fall back to the op that produced the input.
    """
    for _ in range(10):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "_checkpoint_without_reentrant_generator" and code.co_filename == _CHECKPOINT_FILE:
            return frame.f_locals.get("fn")
        frame = frame.f_back
    return None

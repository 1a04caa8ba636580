"""What ``ckpt-soak`` counts at a snapshot: live tensors and the bytes of every live storage (those only autograd
holds included, ``LiveStorages``), hooks, the saved-tensor-hook and mode stacks, and what a step leaves in
reference cycles (``counting_cycles``). ``ckpt_tools/soak.py`` takes them before and after each mode.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ckpt_plugin._compat import (
    TorchDispatchMode,
    global_hook_count,
    hook_count,
    mode_stack_depth,
    saved_tensors_hooks_depth,
)

__all__ = ["LiveStorages", "Snapshot", "count_hooks", "counting_cycles", "rss_bytes"]


class LiveStorages(TorchDispatchMode):
    """Every storage an op makes while this mode is active, held weakly: which are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}  # id(storage) -> weak reference, dropped when it dies

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
                self._add(st)
        return out

    def _add(self, st: torch.UntypedStorage) -> None:
        key = id(st)  # storages keep their Python object while the C++ storage lives (torch preserves it)
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, lambda _ref, key=key: self._refs.pop(key, None))

    def alive(self) -> list[torch.UntypedStorage]:
        return [st for ref in list(self._refs.values()) if (st := ref()) is not None]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # tensors without storage (wrapper subclasses)
        return None


def count_hooks(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """Hooks on ``model``'s modules and parameters, on ``optimizer``, and torch's global module and optimiser hooks."""
    n = 0
    if model is not None:
        n += sum(hook_count(m) for m in model.modules())
        n += sum(hook_count(p) for p in model.parameters())
    if optimizer is not None:
        n += hook_count(optimizer)
    return n + global_hook_count()


def saved_hooks_depth() -> int:
    """Depth of the ``saved_tensors_hooks`` stack."""
    return saved_tensors_hooks_depth()


def mode_depth() -> int:
    """Dispatch plus function modes on their stacks."""
    return mode_stack_depth()


def rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


@dataclass
class Snapshot:
    tensors: int
    tensor_bytes: int
    storages: int
    hooks: int
    saved_hooks: int
    modes: int  # without the soak's own LiveStorages
    rss: int | None  # noisy: reported, never checked

    EXACT: ClassVar[tuple[str, ...]] = ("tensors", "tensor_bytes", "storages", "hooks", "saved_hooks", "modes")

    @classmethod
    def take(cls, model: nn.Module | None, optimizer: torch.optim.Optimizer | None, live: LiveStorages) -> Snapshot:
        """Everything live now; hooks of ``model`` and ``optimizer`` (None: torch's global hooks only)."""
        gc.collect()
        with warnings.catch_warnings():  # some module objects warn when their class is asked for
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        storages = {id(st): st for st in live.alive()}
        storages.update((id(st), st) for t in tensors if (st := _storage(t)) is not None)
        return cls(len(tensors), sum(st.nbytes() for st in storages.values()), len(storages),
                   count_hooks(model, optimizer), saved_hooks_depth(), mode_depth() - 1, rss_bytes())


@contextlib.contextmanager
def counting_cycles(result: dict[str, int]) -> Iterator[None]:
    """With ``gc`` off inside, count what the body left in reference cycles (objects, tensors among them)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)  # unreachable objects go to gc.garbage instead of being freed
        try:
            gc.collect()
            result["cycle_objects"] = len(gc.garbage)
            result["cycle_tensors"] = sum(isinstance(o, torch.Tensor) for o in gc.garbage)
            gc.garbage.clear()
        finally:
            gc.set_debug(0)
            if enabled:
                gc.enable()
            gc.collect()  # now free them

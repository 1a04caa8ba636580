"""Keep the tensors autograd saves for backward in CPU memory.

    with offloading():          # saved activations go to (pinned) host memory ...
        loss = model(x).sum()
    loss.backward()             # ... and come back to the device when backward needs them

    with offloading() as off:
        loss = model.loss(batch)
    off.stats.moved_bytes       # what that forward put in host memory

With non-reentrant ``torch.utils.checkpoint`` inside the context, the
innermost saved-tensor hooks win: a checkpointed region's own saves are
checkpoint's business, and what is offloaded is what checkpoint keeps, the
inputs of each region.

What moves (``should_move``), from torch's ``save_on_cpu`` (moves everything)
and torchtune's ``OffloadActivations`` (skips parameters and small tensors):

- not parameters, views of them, or other leaves that require grad: the
  model holds them anyway, a host copy would only add memory and traffic;
- not storages under ``min_bytes``: the copy would cost more than it frees;
- not tensor subclasses, sparse, quantized, nested or lazily conjugated
  tensors: their bytes alone do not describe them;
- tensors already in CPU memory stay as they are (the very same tensor).

Copies are made per storage, not per tensor: views saved by several ops (q, k,
v split from one qkv output) cost one copy, and each comes back with its own
size, stride and offset, so backward runs on exactly the layout it would have
had. A storage modified in place between two saves is copied again (the key
includes the version counter, which views share).

On CUDA the copies out run on a side stream, overlapping the forward; in
backward each call's bytes come back ahead of use on a second stream; host
memory is a pinned pool reused from the second step on. How, and why, is in
``offload_copies.py``: an :class:`~ckpt_plugin.engine.offload_copies.Offloader`
does the copying, and one serves every context of its owner (an installation's
layers: ``engine/wrap.py``), so that the calls of one step are known in order.
The source is not otherwise protected from in-place writes during the copy:
writing to a saved tensor bumps its version counter, and autograd refuses such
a graph in backward anyway.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ckpt_plugin._compat import (
    StorageWeakRef,
    active_fake_mode,
    base_of,
    checkpoint_placeholder,
    is_fake,
    outer_saved_tensors_hooks,
    version,
)
from ckpt_plugin.engine.offload_copies import HostCopy, Offloader

__all__ = ["OFFLOAD_MIN_BYTES", "NothingToMoveNotice", "OffloadStats", "Offloading", "offloading", "should_move"]

OFFLOAD_MIN_BYTES = 1024  # storages under this stay on the device: the copy would cost more than it frees (torchtune's too)
NOTHING_TO_MOVE = "ckpt.offload: the saved activations are already in CPU memory; there is nothing to move"

def _rank_zero() -> bool:
    """Whether this process is the first of its job (as Lightning's rank_zero_warn decides, without Lightning):
    the process group's rank once there is one, else the launcher's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def should_move(t: torch.Tensor, min_bytes: int) -> bool:
    """Whether ``t`` is worth keeping in host memory, judged by its role and size, not its device."""
    base = base_of(t)
    root = base if base is not None else t  # a view of a weight is the weight
    if isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad):
        return False
    if (type(t) is not torch.Tensor and not is_fake(t)) or t.layout != torch.strided or t.is_nested or t.is_quantized:
        return False
    if t.is_conj() or t.is_neg() or t.device.type == "meta":  # the bytes alone would lose the lazy bit
        return False
    return t.untyped_storage().nbytes() >= min_bytes


class NothingToMoveNotice:
    """Says :data:`NOTHING_TO_MOVE` at most once, however many offloading contexts share it.

    The engine enters a fresh context on every call of a wrapped layer, every step: a warning per
    context would flood the log, and Python's own once-per-location registry is reset by Lightning's
    and pytest's filters, so it cannot be relied on. So the owner of the contexts owns the notice: an
    installation's ``Treatment`` (one notice for all its layers and steps), one ``checkpoint(fn,
    offload=True)`` transform, or one context of :func:`offloading`, reused or not.
    """

    def __init__(self) -> None:
        self.given = False

    def give(self, stacklevel: int = 1) -> None:
        """Warn, the first time only; ``stacklevel`` as for ``warnings.warn``, counted from the caller."""
        if self.given:
            return
        self.given = True
        if _rank_zero():
            warnings.warn(NOTHING_TO_MOVE, UserWarning, stacklevel=stacklevel + 1)


@dataclass
class OffloadStats:
    """What one use of the context did with the tensors autograd saved."""

    moved_bytes: int = 0  # unique storages copied to host memory
    moved_storages: int = 0
    kept_on_device: int = 0  # saves left where they were: parameters, small, unsupported
    already_on_cpu: int = 0  # saves that would have moved but were in CPU memory already


_Packed = Any  # the tensor itself, or (HostCopy, dtype, offset, size, stride)


class Offloading(saved_tensors_hooks):
    """Saved-tensor hooks that keep activations in host memory; build it with :func:`offloading`."""

    # Device types whose memory is host memory: nothing to copy from them.
    # Tests empty it in a subclass to run the copy path on a CPU-only machine.
    _in_host_memory: tuple[str, ...] = ("cpu",)

    def __init__(self, *, min_bytes: int = OFFLOAD_MIN_BYTES, notice: NothingToMoveNotice | None = None,
                 offloader: Offloader | None = None, per_tensor: bool = True) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"ckpt.offload: min_bytes must be a whole number of bytes >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.notice = notice if notice is not None else NothingToMoveNotice()  # shared by the caller's contexts
        # Shared by the caller's contexts too (an installation's layers): one pool, one order of calls per step.
        self.offloader = offloader if offloader is not None else Offloader()
        # What the offloader orders as one call: each copied storage (a context around a whole forward, a chain of
        # segments), or everything one use of the context copies (a layer's call: ``engine/wrap.py``).
        self.per_tensor = per_tensor
        self.stats = OffloadStats()  # of the last use; a fresh one on every `with`
        self._copies: dict[tuple[StorageWeakRef, int], HostCopy] = {}  # (storage, version) -> copy, this use
        self._call: Any = None  # this use's call, as the offloader orders them (begun at the first copy)
        self._outer: tuple[Any, Any] | None = None
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> Offloading:
        self.stats = OffloadStats()
        self._call = None
        # What we keep on the device still goes through the hooks around us, so
        # outer measurements (measure.saved_bytes) see it as autograd would.
        self._outer = outer_saved_tensors_hooks()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._copies.clear()  # the packed entries hold what they need
        if self._call is not None:
            self.offloader.end(self._call)  # earlier calls' bytes leave the device
        self._call = None
        nothing_moved = self.stats.already_on_cpu and not self.stats.moved_bytes
        if nothing_moved and exc[0] is None:
            self.notice.give(stacklevel=2)  # points at the user's `with`

    def _pack(self, t: torch.Tensor) -> _Packed:
        if checkpoint_placeholder(t):  # torch 2.11's 0-byte placeholder of a region: kept, and counted by no stat
            return self._keep(t)
        if not should_move(t, self.min_bytes):
            self.stats.kept_on_device += 1
            return self._keep(t)
        if t.device.type in self._in_host_memory:
            self.stats.already_on_cpu += 1
            return self._keep(t)
        if not is_fake(t) and active_fake_mode() is not None:  # a real input of a step measured on fake tensors
            return self._keep(t)  # (the batch): kept, never copied for real by a measurement
        key = (StorageWeakRef(t.untyped_storage()), version(t))
        copy = self._copies.get(key)
        if copy is None:
            if self.per_tensor:
                call = self.offloader.begin()
                copy = self._copies[key] = self.offloader.copy_out(t, call)
                self.offloader.end(call)
            else:
                if self._call is None:  # begun at the first copy: a call that moves nothing takes no place
                    self._call = self.offloader.begin()
                copy = self._copies[key] = self.offloader.copy_out(t, self._call)
            self.stats.moved_bytes += copy.nbytes
            self.stats.moved_storages += 1
        copy.packs += 1
        return copy, t.dtype, t.storage_offset(), t.size(), t.stride()

    def _keep(self, t: torch.Tensor) -> Any:
        # Detached, as in measure.SavedCounter.pack: the tensor itself would make a cycle (pytorch#115255).
        return t.detach() if self._outer is None else _Outer(self._outer[0](t), self._outer[1])

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        copy, *layout = packed
        return self.offloader.bring_back(copy, *layout)


@dataclass
class _Outer:
    """A tensor kept on its device, packed by the hooks that were active around ours."""

    packed: Any
    unpack: Any


def offloading(*, min_bytes: int = OFFLOAD_MIN_BYTES, notice: NothingToMoveNotice | None = None,
               offloader: Offloader | None = None, per_tensor: bool = True) -> Offloading:
    """Context under which the tensors autograd saves for backward are kept in CPU memory.

    ``min_bytes``: storages smaller than this stay on the device (torchtune's
    default too). ``with offloading() as off:`` gives ``off.stats``
    (:class:`OffloadStats`) of that use. ``notice``: the :class:`NothingToMoveNotice` shared
    by every context of one owner (that the activations are in CPU memory already is said once
    per notice); None: the context's own, said once however often the context is entered.
    ``offloader``: the :class:`~ckpt_plugin.engine.offload_copies.Offloader` (host pool, copy
    streams, the step's calls in order) shared by the contexts of one owner; None: the context's
    own, reused however often the context is entered. ``per_tensor``: each storage copied is one call of the
    offloader's order (in flight out, then back ahead of use, ``ahead`` at a time): right for a context around
    a whole forward; False: each use of the context is one call (an installation's layer, brought back whole).
    """
    return Offloading(min_bytes=min_bytes, notice=notice, offloader=offloader, per_tensor=per_tensor)

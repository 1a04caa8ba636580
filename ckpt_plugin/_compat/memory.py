"""``MemTracker`` (private: ``torch.distributed._tools``) as the measurements use it: each category's own peak,
recomputation counted as activations, frozen parameters tracked; ModTracker, whose module hooks ZeRO-3's played
gathering runs on (``apply/zero3_gather.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker  # private: torch._tools
from torch.distributed._tools.mod_tracker import ModTracker  # private: torch._tools

_TOTAL = "Total"  # the key of a device snapshot's total (MemTracker's _TOTAL_KEY)


class _NoHook:
    """A removable handle of a hook never registered."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _by_category(snapshot: dict[Any, int]) -> dict[str, int]:
    """A device's snapshot keyed by MemTracker's category values, lower case (``gradient``), and ``total``."""
    return {getattr(key, "value", str(key)).lower(): value for key, value in snapshot.items()}


def _grads(snapshot: dict[Any, int]) -> int:
    return sum(value for key, value in snapshot.items() if getattr(key, "value", "") == "Gradient")


class CategoryPeakTracker(MemTracker):
    """``MemTracker`` that also records each category's own peak over the step.

    MemTracker's ``get_tracker_snapshot("peak")`` gives the split at the moment
    the *total* peaked; the activation peak is usually earlier (end of forward)
    than the total peak (gradients alive), so we keep the per-category maxima
    from the same live snapshot MemTracker updates after every op.
    """

    def __init__(self, *args: Any, moments: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.category_peaks: dict[str, int] = {}
        self._moments = moments  # off unless asked: they cost a little on every op of every measured step
        # Two more moments, for a strategy whose step differs from this process's (DeepSpeed ZeRO, apply/zero.py):
        # the categories where the total less the gradients peaked outside the optimizer's step (gradients that
        # leave for a reduce bucket as backward makes them), and where the total peaked inside it.
        self.gradless_peak: dict[str, int] = {}
        self.optimizer_peak: dict[str, int] = {}
        self.gradless_at: dict[int, int] = {}  # in backward: gradient bytes alive -> the most the rest held then

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # MemTracker files what backward makes as temporaries, except inside a recomputation
        # that a module's own forward hooks announce (``_in_ac``): the recompute of a module
        # wrapped by an instance-level forward, or of a plain function, would land in TEMP
        # op by op, between the hooks of its submodules. In backward, autograd runs its nodes
        # with grad mode off (unless create_graph), and checkpoint re-enables it for the
        # recomputation: so a grad-enabled op in backward is a recomputed activation.
        #
        # Lightning steps with ``optimizer.step(closure)``: forward and backward run inside the step, under
        # MemTracker's optimizer pre-hook, which would file them all as optimizer state. torch's optimizers do
        # their own math with grad mode off, and the closure runs forward with it on; so an op under the step
        # with grad mode on, or in backward, is the closure's, filed as MemTracker files it outside a step.
        if self._in_opt and (torch.is_grad_enabled() or self._mod_tracker.is_bw):
            self._in_opt = False
            try:
                return self.__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_opt = True
        if not self._in_ac and torch.is_grad_enabled() and self._mod_tracker.is_bw:
            self._in_ac = True
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_ac = False
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        # MemTracker registers a gradient hook on every parameter of every module it enters, and
        # register_hook raises on one that does not require grad (torch 2.13): a frozen sinusoidal
        # position table (Pegasus, Marian, Whisper), a LoRA's frozen base. Such a parameter never
        # gets a gradient, so it is marked as hooked already, with handles that remove nothing.
        # FSDP (v1, use_orig_params=True) sets a unit's parameters to views of its gathered flat parameter
        # in forward: not leaves, so a gradient hook cannot be registered; their gradient is the flat one's.
        for param in module.parameters():
            if (not param.requires_grad or not param.is_leaf) and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state: Any) -> None:  # private hook of MemTracker, after every op
        # MemTracker's own also walks every module it has seen (a weak dictionary) to update each module's peak:
        # per op, as many weak lookups as the model has modules. The measurements read the step's peak and
        # its split only, so only those are kept, as MemTracker keeps them (``_peak_mem``, ``_peak_mem_snap``).
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap[_TOTAL]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)
            for key, value in dev_snap.items():
                name = getattr(key, "name", str(key)).lower()
                if value > self.category_peaks.get(name, 0):
                    self.category_peaks[name] = value
            if not self._moments:
                continue
            if self._in_opt:
                if total > self.optimizer_peak.get("total", 0):
                    self.optimizer_peak = _by_category(dev_snap)
            else:
                grads = _grads(dev_snap)
                if total - grads > self.gradless_peak.get("total", 0) - self.gradless_peak.get("gradient", 0):
                    self.gradless_peak = _by_category(dev_snap)
                if self._mod_tracker.is_bw and total - grads > self.gradless_at.get(grads, 0):  # (in forward: the
                    # last step's gradients, which Lightning's zero_grad frees only after training_step)
                    self.gradless_at[grads] = total - grads


def as_parameter(tensor: torch.Tensor) -> None:
    """File ``tensor``'s storage under MemTracker's parameters, in every MemTracker measuring now (a ZeRO-3 rank's
    gathered parameter, which the step allocates: MemTracker would file it as an activation or a temporary).
    ``_update_and_maybe_create_winfos`` is MemTracker's own (private) way to file a tensor it has seen."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemTracker):
            mode._update_and_maybe_create_winfos(tensor, _MemRefType.PARAM)


def at_backward_end(callback: Any) -> None:
    """Run ``callback()`` when the backward pass running now ends (autograd's engine, private: the call
    DeepSpeed's and FSDP's own end-of-backward work is queued with)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def seen_bytes(tracker: MemTracker, tensors: Any) -> int:
    """Bytes of the storages of ``tensors`` (a pytree) that ``tracker`` counted, made before it started: a batch
    that a strategy's hook passed through an op (DeepSpeed ZeRO-3 detaches each module's inputs), whose storage
    MemTracker then files as an activation. ``_WINFO`` is MemTracker's own (private) table of what it counts."""
    from torch.utils._pytree import tree_leaves

    storages = {id(t.untyped_storage()): t.untyped_storage() for t in tree_leaves(tensors)
                if isinstance(t, torch.Tensor)}
    return sum(s.nbytes() for s in storages.values() if s in tracker._WINFO)


__all__ = ["CategoryPeakTracker", "MemTracker", "ModTracker", "as_parameter", "at_backward_end", "seen_bytes"]

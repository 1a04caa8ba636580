"""The two dispatch modes of one selectively checkpointed call: what its forward saves, what its recomputation
hands back.

``policies.SelectivePolicy.context_fn`` gives them to ``checkpoint``: the forward's mode runs every op and
keeps the outputs the policy saves, passed through the ``saved_tensors_hooks`` that were active around the
checkpoint call (torch's own modes keep them in a private dict those hooks never see, so they would escape
``measure.saved_bytes`` and CPU offloading); the recomputation's mode hands them back by (op, n-th call of
op) and runs everything else again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

import torch

from ckpt_plugin._compat import TorchDispatchMode, is_mutable as _is_mutable
from ckpt_plugin._compat import storage_key as _storage_key, written as _written
from ckpt_plugin._compat import outer_saved_tensors_hooks as _outer_saved_tensors_hooks, version as _version
from ckpt_plugin.engine.selective.name_tags import NAMING

# Ops that checkpoint itself runs a different number of times in forward and recompute
# (torch's SAC_IGNORED_OPS): counting them would misalign the replay.
_UNCOUNTED = {torch.ops.aten.detach.default, torch.ops.prim.device.default}


class RegionPolicy(Protocol):
    """What a region asks of its policy (``policies.SelectivePolicy``)."""

    uses_names: bool  # the policy goes by checkpoint_name tags: the region's tags are live

    def saves(self, op: Any, args: tuple, kwargs: dict, *, record: bool = True) -> bool: ...

    def before_recompute(self) -> None: ...


def region_modes(policy: RegionPolicy, module: str | None = None) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """(forward, recompute) dispatch modes of one checkpointed call under ``policy``; ``module``: the name of
    the module checkpointed, for errors."""
    region = _Region(policy, module)
    return _SaveMode(region), _ReplayMode(region)


class SavedOutputModified(RuntimeError):
    """A selective policy saved an op's output that was then modified in place after the region returned it: the
    recomputation would read the modified value. ``op``: that op; ``module``: the name of the checkpointed module
    whose forward saved it, where known (``wrap.CheckpointedForward`` gives it)."""

    def __init__(self, op: Any, module: str | None = None) -> None:
        self.op, self.module = op, module
        of = f" of {module}" if module else ""
        super().__init__(
            f"selective checkpointing{of} saved the output of {op} and it was then modified in place (an "
            "inplace op such as ReLU(inplace=True) on it); the recomputation would use the modified "
            f"value. Make that op out-of-place, or leave {op} out of ckpt.policy."
        )


class _Saved:
    """One saved output: packed by the caller's hooks if any, else kept as a detached alias.

    An op of the region about to write into it (``scores.add_(mask)``, through a view
    too) makes it keep a copy of its value first (``before_write``): the recomputation
    hands that back, and the same write runs on it again. A write after the region
    (the region returned it) cannot be seen coming: ``value`` refuses it, naming the op
    and the module (``SavedOutputModified``).
    """

    __slots__ = ("op", "module", "tensor", "version", "packed", "pack", "unpack", "aliases")

    def __init__(self, op: Any, out: torch.Tensor, hooks: tuple[Any, Any] | None, module: str | None) -> None:
        self.op, self.module, self.version = op, module, _version(out)
        # The op's own output until the forward ends: beneath autograd, a detached tensor
        # gets a version counter of its own and would miss in-place writes to the output.
        self.tensor: torch.Tensor | None = out
        self.pack, self.unpack = hooks if hooks else (None, None)
        self.packed = self.pack(out.detach()) if self.pack else None
        # Later outputs of the region on the same storage that autograd does not count as views, so that
        # they keep a version counter of their own: ``_unsafe_view`` (torch 2.15's ``linear`` on a 3-d
        # input returns the addmm output through it, 2.13's through a view). A write into one of them
        # after the region is a write into this output: ``value`` checks theirs too.
        self.aliases: list[tuple[torch.Tensor, int]] = []

    def _aliased(self, out: torch.Tensor) -> bool:
        """Whether the hook kept the output itself (a counter's), not a copy (offload's)."""
        return isinstance(self.packed, torch.Tensor) and _storage_key(self.packed) == _storage_key(out)

    def before_write(self) -> None:
        """An op of the region is about to write into the output: keep its value as it is now (a hook's copy
        has it already). A counter's hook then counts both the output and the copy: our own byte counts,
        not MemTracker's, take this rare layer as keeping one output more."""
        if self.pack is not None and not self._aliased(self.tensor):
            self.version = -1  # the copy stands alone: nothing to compare
            return
        kept = self.tensor.detach().clone()
        self.tensor, self.version, self.aliases = kept, _version(kept), []
        self.packed = self.pack(kept.detach()) if self.pack else None

    def end_of_forward(self) -> None:
        out = self.tensor
        # Let go of the output's autograd history, which would hold the region in a cycle. A detached
        # alias, made outside dispatch, shares the output's version counter (one made beneath autograd,
        # as the hook got it, has its own): kept unpacked, or where the hook kept the output itself (a
        # counter's), whose writes would reach it. A hook's copy (offload's) stands for it alone.
        self.tensor = out.detach() if self.unpack is None or self._aliased(out) else None
        # The aliases only where the output itself is kept (their storage is then held anyway): beside a hook's
        # copy, or a holder that drops the output (an enclosing checkpoint's, ``full`` with parts inside), they
        # would keep the storage alive to backward, bytes the peak model does not count.
        kept = self.version >= 0 and self.tensor is not None
        self.aliases = [(alias.detach(), v) for alias, v in self.aliases] if kept else []
        if self.version >= 0 and _version(out) != self.version:
            raise SavedOutputModified(self.op, self.module)

    def value(self) -> torch.Tensor:
        if self.tensor is not None and _version(self.tensor) != self.version or any(
                _version(alias) != v for alias, v in self.aliases):
            raise SavedOutputModified(self.op, self.module)
        return self.unpack(self.packed) if self.unpack is not None else self.tensor


def _map(fn: Any, out: Any) -> Any:
    """``fn`` over the leaves of an op's output (a tensor, or a tuple/list of tensors and others)."""
    return type(out)(_map(fn, o) for o in out) if isinstance(out, (tuple, list)) else fn(out)


class _Region:
    """One checkpointed call: the outputs its forward saved, keyed by (op, n-th call of op)."""

    def __init__(self, policy: RegionPolicy, module: str | None = None) -> None:
        self.policy, self.module = policy, module  # module: the checkpointed module's name, for errors
        # context_fn runs before checkpoint installs its own hooks: these are the caller's.
        self.hooks = _outer_saved_tensors_hooks()
        self.saved: dict[tuple[Any, int], Any] = {}
        self.fresh: list[_Saved] = []  # saved by the forward running now
        self.unwritten: dict[Any, list[_Saved]] = {}  # storage -> those of fresh still as the op wrote them

    def save(self, key: tuple[Any, int], out: Any) -> None:
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            saved = _Saved(key[0], t, self.hooks, self.module)
            self.fresh.append(saved)
            self.unwritten.setdefault(_storage_key(t), []).append(saved)
            return saved

        self.saved[key] = _map(one, out)

    def after(self, out: Any) -> None:
        """An op of the region returned ``out``: an output on the storage of a saved one, not yet written, is
        an alias whose writes ``_Saved.value`` must see too (see ``_Saved.aliases``)."""
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                for saved in self.unwritten.get(_storage_key(t), ()):
                    if t is not saved.tensor:
                        saved.aliases.append((t, _version(t)))

    def before(self, func: Any, args: tuple, kwargs: dict) -> None:
        """``func`` is about to run: the saved outputs it writes into keep their values first."""
        if self.unwritten:
            for t in _written(func, args, kwargs):
                for saved in self.unwritten.pop(_storage_key(t), ()):
                    saved.before_write()

    def end_of_forward(self) -> list[_Saved]:
        """The outputs the forward saved, now that it has ended (each to let go of the output)."""
        fresh, self.fresh, self.unwritten = self.fresh, [], {}
        return fresh


class _RegionMode(TorchDispatchMode):
    def __init__(self, region: _Region) -> None:
        super().__init__()
        self.region = region
        self.calls: dict[Any, int] = defaultdict(int)

    def key(self, op: Any) -> tuple[Any, int]:
        self.calls[op] += 1
        return op, self.calls[op] - 1

    def __enter__(self) -> _RegionMode:
        self.calls.clear()
        self._token = NAMING.set(self.region.policy.uses_names)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        NAMING.reset(self._token)


class _SaveMode(_RegionMode):
    """Forward: run every op, keep the outputs the policy saves."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.region.before(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.region.unwritten and not _is_mutable(func):
            self.region.after(out)
        if func not in _UNCOUNTED:
            key = self.key(func)
            if self.region.policy.saves(func, args, kwargs):
                self.region.save(key, out)
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        errors = []
        for saved in self.region.end_of_forward():  # every one lets go of its output, even past an error
            try:
                saved.end_of_forward()
            except RuntimeError as err:
                errors.append(err)
        if errors and exc[0] is None:
            raise errors[0]


class _ReplayMode(_RegionMode):
    """Recomputation: hand back what was saved, run everything else again."""

    def __enter__(self) -> _RegionMode:
        self.region.policy.before_recompute()
        # Unpack here, outside dispatch: an unpack hook may run ops of its own (copies back
        # from CPU, an enclosing checkpoint's recomputation).
        unpack = lambda e: e.value() if isinstance(e, _Saved) else e  # noqa: E731
        self.ready = {key: _map(unpack, entry) for key, entry in self.region.saved.items()}
        # Consumed once: a second backward (retain_graph=True) recomputes everything.
        self.region.saved.clear()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.ready = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = _RECOMPUTE if func in _UNCOUNTED else self.ready.pop(self.key(func), _RECOMPUTE)
        return func(*args, **(kwargs or {})) if out is _RECOMPUTE else out


_RECOMPUTE = object()


__all__ = ["RegionPolicy", "SavedOutputModified", "region_modes"]

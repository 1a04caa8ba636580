"""How we measure, the same way in the callback's report, tests and benchmarks.

- saved-activation bytes: unique storages packed by
  ``torch.autograd.graph.saved_tensors_hooks`` during a forward, parameters
  and buffers excluded, plus the inputs a checkpointed module holds for its
  recomputation;
- peak memory by category: torch's ``MemTracker`` (exact on CPU);
- recompute: ``FlopCounterMode`` FLOPs of a whole step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin._compat import CategoryPeakTracker, base_of, checkpoint_placeholder, storage_key, tree_leaves

REST = "(rest of model)"


@dataclass
class SavedBytes:
    """Bytes kept for backward after one forward, attributed to wrapped modules."""

    by_owner: dict[str, int] = field(default_factory=dict)  # module name or REST -> bytes

    @property
    def total(self) -> int:
        return sum(self.by_owner.values())


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` for a matmul). Sharding strategies gather
    parameters into fresh storage for the forward (FSDP, FSDP2, ZeRO-3), so storage identity
    with ``model.parameters()`` taken between steps does not find them; the object does."""
    return isinstance(t, nn.Parameter) or isinstance(base_of(t), nn.Parameter)


class SavedCounter:
    """Counts each storage once, under the owner active when it was first seen."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: set[tuple[str, int]] = {storage_key(t) for t in model.parameters()}
        self.seen |= {storage_key(t) for t in model.buffers()}
        self.owners: list[str] = [REST]
        self.result = SavedBytes()

    def add(self, t: torch.Tensor) -> None:
        if is_parameter(t):
            return
        key = storage_key(t)
        if key in self.seen:
            return
        self.seen.add(key)
        owner = self.owners[-1]
        self.result.by_owner[owner] = self.result.by_owner.get(owner, 0) + t.untyped_storage().nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not checkpoint_placeholder(t):  # torch 2.11's 0-byte placeholder of a region: no owner gets a row for it
            self.add(t)
        # Detached: a saved output handed back as itself holds its own grad_fn, a reference
        # cycle through C++ that gc cannot free, so a forward without backward (the report's)
        # would leak its whole graph (pytorch#115255; found by ckpt-soak).
        return t.detach()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that count what autograd saves and change nothing."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _same)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def saved_bytes(model: nn.Module, run: Callable[[], Any], owners: list[str],
                beyond_inputs: Collection[str] = ()) -> SavedBytes:
    """Run ``run()`` (a forward of ``model``) and count what autograd keeps for backward.

    Bytes saved while a module in ``owners`` (qualified names) runs are
    attributed to it, the rest to ``REST``. A module wrapped by checkpointing
    saves nothing itself, but holds its inputs for recomputation: those count
    too, under its name. An owner in ``beyond_inputs`` is charged only what it
    keeps beyond its inputs (what checkpointing it would free); its inputs, unless
    saved before it ran, count under no one, and are held until ``run`` returns
    (so that no later storage takes their identity). The forward's output is
    dropped before returning.
    """
    counter = SavedCounter(model)
    modules = dict(model.named_modules())
    wrapped = {name for name in owners if "forward" in modules[name].__dict__}
    held: list[torch.Tensor] = []
    handles = []
    for name in owners:
        module = modules[name]

        def pre(_m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            counter.owners.append(name)
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name in beyond_inputs:
                held.extend(inputs)
                counter.seen.update(storage_key(t) for t in inputs)
            elif name in wrapped:
                for t in inputs:
                    counter.add(t)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            counter.owners.pop()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.enable_grad(), counter.hooks():
            run()
    finally:
        for h in handles:
            h.remove()
    return counter.result


@contextlib.contextmanager
def side_effect_free(model: nn.Module) -> Iterator[None]:
    """Run a measuring forward without touching RNG streams or buffers (BatchNorm stats)."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def step_memory(step: Callable[[], Any], model: nn.Module) -> dict[str, int]:
    """Peak bytes of one training step by MemTracker category (``act``, ``temp``, ``total``, ...)."""
    tracker = CategoryPeakTracker()
    tracker.track_external(model)
    with tracker:
        step()
    return dict(tracker.category_peaks)


def step_flops(step: Callable[[], Any]) -> int:
    """FLOPs of one call of ``step`` (forward, backward and any recomputation)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()

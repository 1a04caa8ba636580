"""Segments over a chain of layers, without editing the parent's ``forward``.

``ckpt.segments`` groups consecutive selected layers (children of one
``nn.Sequential`` or ``nn.ModuleList``) into checkpointed regions. A region
spans several module calls made by the parent's own ``forward``, so it cannot
be one ``checkpoint(fn, x)`` call: it is opened by a forward pre-hook on its
first layer and closed by a forward hook on its last, with torch's
non-reentrant checkpoint generator (the mechanism of torch's composable
``checkpoint``, reached through ``_compat``). Every layer still runs once, in
place, through its own ``__call__``.

Recomputation replays the region as a chain: layer ``k+1`` gets layer ``k``'s
output. That is only right if the parent does exactly that, so every call is
checked: a layer inside a region must receive the very tensor the previous
layer returned, and nothing else. Anything else raises before a wrong
gradient can exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from torch.utils.checkpoint import noop_context_fn

from ckpt_plugin._compat import close_region, open_region
from ckpt_plugin.errors import Problem
from ckpt_plugin.engine.norms import running_stats
from ckpt_plugin.engine.sequential import Node, Region, regions, schedule
from ckpt_plugin.engine.treatment import Treatment

ATTR = "_ckpt_plugin_chain"  # where a chained layer keeps its ChainCheckpoint (not in state_dict)


class ChainCheckpoint:
    """Checkpoint regions over ``layers`` (consecutive siblings, in call order)."""

    def __init__(self, names: list[str], layers: list[nn.Module], segments: int | str, treatment: Treatment):
        self.names, self.layers = names, layers
        self.nodes = schedule(len(layers), segments)
        self.treatment = treatment
        self.preserve_rng_state = treatment.preserve_rng_state
        all_regions = regions(self.nodes)
        self.opens_at = {i: [r for r in all_regions if r.start == i] for i in range(len(layers))}  # outer first
        self.closes_at = {i: [r for r in reversed(all_regions) if r.stop == i + 1] for i in range(len(layers))}
        self.inside = {i: any(r.start < i < r.stop for r in all_regions) for i in range(len(layers))}
        self._context_fns = {
            r: treatment.context_fn([s for k in range(r.start, r.stop) for s in running_stats(layers[k])])
            for r in all_regions
        }
        self._offload: Any = None  # the offloading context spanning the chain, while it runs
        self._open: list[tuple[Region, Any]] = []
        self._last_output: Any = None
        self._last_index = -1
        self._replaying = 0
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post(i), always_call=True))
            layer.__dict__[ATTR] = self

    def remove(self) -> None:
        self._abandon()
        for handle in self._handles:
            handle.remove()
        for layer in self.layers:
            layer.__dict__.pop(ATTR, None)

    # -- forward, driven by the parent's calls ----------------------------------------------

    def _pre(self, i: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying:
                return
            if i == 0:
                self._abandon()  # regions left open by an exception in the last forward
                if self.treatment.offload:
                    # Pushed before the first region opens and popped after the last
                    # closes, so the regions' saved inputs go through it (hooks nest).
                    self._offload = self.treatment.offloading()
                    self._offload.__enter__()
            if self.inside[i]:
                self._check_chain(i, args, kwargs)
            for region in self.opens_at[i]:
                self._enter(region, args, kwargs)

        return hook

    def _post(self, i: int):
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            if self._replaying:
                return
            self._last_output, self._last_index = output, i
            for _region in self.closes_at[i]:
                if not self._open:  # a failed chain check has abandoned them already
                    break
                self._exit()
            if i == len(self.layers) - 1 and self._offload is not None:
                self._offload.__exit__(None, None, None)
                self._offload = None

        return hook

    def _check_chain(self, i: int, args: tuple, kwargs: dict) -> None:
        if self._last_index != i - 1:
            got = f"was called after {self.names[self._last_index]}" if self._last_index >= 0 else "was called first"
        elif kwargs:
            got = "got keyword arguments"
        elif len(args) != 1:
            got = f"got {len(args)} positional arguments"
        elif args[0] is not self._last_output or not isinstance(args[0], torch.Tensor):
            got = "got a different value"
        else:
            return
        self._abandon()
        raise RuntimeError(
            f"ckpt.segments: {self.names[i]} did not take {self.names[i - 1]}'s output as its one input "
            f"(it {got}), "
            f"so these layers are not a chain and a segment cannot be recomputed from its first input. "
            f"Use segments only over layers that feed each other one tensor (an nn.Sequential, or a "
            f"ModuleList applied as x = layer(x)), or set ckpt.segments=null to checkpoint each layer."
        )

    def _enter(self, region: Region, args: tuple, kwargs: dict) -> None:
        gen = open_region(self._replay(region), self.preserve_rng_state, self._context_fns[region] or noop_context_fn, *args, **kwargs)
        self._open.append((region, gen))

    def _exit(self) -> None:
        _region, gen = self._open.pop()
        close_region(gen)

    def _abandon(self) -> None:
        while self._open:
            _region, gen = self._open.pop()
            gen.close()
        if self._offload is not None:
            self._offload.__exit__(None, None, None)
            self._offload = None

    # -- recomputation, driven by autograd ----------------------------------------------------

    def paused(self) -> contextlib.AbstractContextManager:
        """The layers run plainly, as if not wrapped (for measuring the run without)."""
        return self._hooks_off()

    @contextlib.contextmanager
    def _hooks_off(self) -> Iterator[None]:
        self._replaying += 1
        try:
            yield
        finally:
            self._replaying -= 1

    def _replay(self, region: Region):
        def recompute(*args: Any, **kwargs: Any) -> Any:
            with self._hooks_off():
                return self._run(region.children, *args, **kwargs)

        return recompute

    def _run(self, nodes: tuple[Node, ...], *args: Any, **kwargs: Any) -> Any:
        for node in nodes:
            if isinstance(node, Region):
                gen = open_region(self._replay(node), self.preserve_rng_state, self._context_fns[node] or noop_context_fn, *args, **kwargs)
                try:
                    out = self._run(node.children, *args, **kwargs)
                except BaseException:
                    gen.close()
                    raise
                close_region(gen)
            else:
                out = self.layers[node](*args, **kwargs)
            args, kwargs = (out,), {}
        return out


def chains_of(model: nn.Module) -> list[ChainCheckpoint]:
    seen: list[ChainCheckpoint] = []
    for m in model.modules():
        chain = m.__dict__.get(ATTR)
        if chain is not None and chain not in seen:
            seen.append(chain)
    return seen


def check_consecutive(model: nn.Module, names: list[str]) -> list[Problem]:
    """Problems that keep ``names`` from being one chain (empty: no static reason).

    Each layer's parent must be an ``nn.Sequential`` or ``nn.ModuleList`` and the
    layers under one parent consecutive children; a chain may run on from one
    parent into the next (the Bottlenecks of consecutive ResNet stages). Whether
    each layer really gets the previous one's output is checked on every call.
    """
    problems: list[Problem] = []
    by_parent: dict[str, list[str]] = {}
    for name in names:
        by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    for parent_name, group in by_parent.items():
        parent = model.get_submodule(parent_name)
        where = parent_name or "the model"
        if not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            problems.append(Problem(
                "ckpt.segments",
                f"ckpt.segments: {', '.join(group)} {'is a child' if len(group) == 1 else 'are children'} of "
                f"{where} ({type(parent).__name__}), not of "
                f"an nn.Sequential or nn.ModuleList, so the order they run in is unknown",
                "select blocks of a Sequential/ModuleList, or set ckpt.segments=null",
            ))
            continue
        children = [f"{parent_name}.{k}" if parent_name else k for k, _ in parent.named_children()]
        start = children.index(group[0])
        if children[start : start + len(group)] != group:
            problems.append(Problem(
                "ckpt.segments",
                f"ckpt.segments: {', '.join(group)} are not consecutive children of {where}",
                "select a run of consecutive blocks (ckpt.every_n cannot be combined with segments)",
            ))
    return problems

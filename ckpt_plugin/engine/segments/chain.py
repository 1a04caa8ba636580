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
output, and the other arguments the region's first layer got (the attention
mask and position embeddings a Llama passes every decoder layer as keywords).
That is only right if the parent does exactly that, so every call is checked:
a layer inside a region must receive the very tensor the previous layer
returned first, then the same other arguments as the previous layer (the very
same objects, or equal plain values). Anything else raises before a wrong
gradient can exist. ``chain_check.Links`` decides: the very check that
``apply_checkpointing`` runs on a sample input, when there is one, to refuse
such layers before training (``chain_check.py``). Each layer's arguments go
through ``side_effects.py`` first, in the pre-hook that may replace them: a KV
cache is neutralised in training, for the region's recomputation too, and a
changed mutable argument raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from torch.utils.checkpoint import noop_context_fn

from ckpt_plugin._compat import close_region, open_region
from ckpt_plugin.engine.segments.chain_check import Links, not_a_chain
from ckpt_plugin.engine.norms import running_stats
from ckpt_plugin.engine.offload_copies import Offloader
from ckpt_plugin.engine.segments.sequential import Node, Region, regions, schedule
from ckpt_plugin.engine.side_effects import Prepared, SideEffects
from ckpt_plugin.engine.treatment import Treatment

ATTR = "_ckpt_plugin_chain"  # where a chained layer keeps its ChainCheckpoint (not in state_dict)


class ChainCheckpoint:
    """Checkpoint regions over ``layers`` (consecutive siblings, in call order)."""

    def __init__(self, names: list[str], layers: list[nn.Module], segments: int | str | tuple[Node, ...],
                 treatment: Treatment, side_effects: SideEffects | None = None, offloader: Offloader | None = None):
        self.names, self.layers = names, layers
        # Where the treatment offloads: the installation's host pool and copy streams (offload_copies.py).
        self.offloader = offloader if offloader is not None or not treatment.offload else Offloader()
        self.side_effects = side_effects or SideEffects()
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
        self._links = Links(names)  # what the previous layer took and returned
        self._prepared: Prepared | None = None  # the running layer's, to check after its forward
        self._plain = False  # this forward runs unchecked, without regions (a KV cache in eval mode)
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
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if self._replaying:
                return None
            prepared = self.side_effects.prepare(module, module.forward, args, kwargs)
            if i == 0:
                self._abandon()  # regions left open by an exception in the last forward
                # Hugging Face does not checkpoint in eval mode; a cache there is filled, once.
                self._plain = prepared is not None and prepared.uncheckpointed
                if self.treatment.offload:
                    # Pushed before the first region opens and popped after the last
                    # closes, so the regions' saved inputs go through it (hooks nest).
                    self._offload = self.treatment.offloading(self.offloader, per_tensor=True)
                    self._offload.__enter__()
            if self._plain:
                return None
            self._prepared = prepared
            if prepared is not None:
                args, kwargs = prepared.args, prepared.kwargs
            if self.inside[i]:
                self._check_chain(i, args, kwargs)
            self._links.took(args, kwargs)
            for region in self.opens_at[i]:
                self._enter(region, args, kwargs)
            return (args, kwargs) if prepared is not None and prepared.changed else None

        return hook

    def _post(self, i: int):
        def hook(module: nn.Module, _args: tuple, output: Any) -> None:
            if self._replaying:
                return
            if not self._plain:
                prepared, self._prepared = self._prepared, None
                if prepared is not None and output is not None:  # None: the forward raised
                    try:
                        prepared.check(f"{self.names[i]} ({type(module).__name__})", module.forward, module.training)
                    except RuntimeError:
                        self._abandon()
                        raise
                self._links.returned(i, output)
                for _region in self.closes_at[i]:
                    if not self._open:  # a failed chain check has abandoned them already
                        break
                    self._exit()
            if i == len(self.layers) - 1:
                # Held until the next forward, they would keep this step's graph alive through it.
                self._links.release()
            if i == len(self.layers) - 1 and self._offload is not None:
                self._offload.__exit__(None, None, None)
                self._offload = None

        return hook

    def _check_chain(self, i: int, args: tuple, kwargs: dict) -> None:
        got = self._links.why_not(i, args, kwargs)
        if got is None:
            return
        self._abandon()
        raise RuntimeError(
            f"{not_a_chain(self.names[i], self.names[i - 1], got)}. "
            f"Use segments only over layers that feed each other one tensor and all get the same keyword "
            f"arguments (an nn.Sequential, or a ModuleList applied as x = layer(x, **kwargs)), or set "
            f"ckpt.segments=null to checkpoint each layer."
        )

    def _enter(self, region: Region, args: tuple, kwargs: dict) -> None:
        self._open.append((region, self._open_region(region, args, kwargs)))

    def _open_region(self, region: Region, args: tuple, kwargs: dict) -> Any:
        # The keyword arguments reach the recomputation through its closure: torch reads only the
        # positional ones (for devices and RNG states), and our names cannot collide with its own.
        context_fn = self._context_fns[region] or noop_context_fn
        return open_region(self._replay(region, kwargs), self.preserve_rng_state, context_fn, *args)

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

    def _replay(self, region: Region, kwargs: dict):
        def recompute(*args: Any) -> Any:
            with self._hooks_off():
                return self._run(region.children, args, kwargs)

        return recompute

    def _run(self, nodes: tuple[Node, ...], args: tuple, kwargs: dict) -> Any:
        """The layers of ``nodes`` as a chain: each gets the previous output, then ``args[1:]`` and ``kwargs``."""
        rest = args[1:]
        for node in nodes:
            if isinstance(node, Region):
                gen = self._open_region(node, args, kwargs)
                try:
                    out = self._run(node.children, args, kwargs)
                except BaseException:
                    gen.close()
                    raise
                close_region(gen)
            else:
                out = self.layers[node](*args, **kwargs)
            args = (out, *rest)
        return out


def chains_of(model: nn.Module) -> list[ChainCheckpoint]:
    seen: list[ChainCheckpoint] = []
    for m in model.modules():
        chain = m.__dict__.get(ATTR)
        if chain is not None and chain not in seen:
            seen.append(chain)
    return seen

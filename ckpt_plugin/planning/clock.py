"""Timing one call of a layer: on fresh copies of its real inputs, options interleaved, the median kept.

The median and not the minimum: we predict a typical step, and the median of
three drops one outlier on either side, where the minimum picks each option's
one lucky sample on its own (on the example ResNet the two predicted alike;
``docs/bench/timing.md``). Alike layers are timed once: what a call's time
depends on (:func:`layer_kind`, :func:`input_signature`) keys ``timing.py``'s cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import keystr, tree_flatten_with_path, tree_leaves, tree_map


def time_calls(runs: dict[str, Callable[..., Any]], args: tuple, kwargs: dict, params: list[nn.Parameter],
               repeats: int, now: Callable[[], float]) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of ``run`` forward + backward per option, options interleaved, after one warm-up each; and
    of its forward alone (what a copy out can hide behind: ``offload_plan.py``), read in the same calls."""
    samples: dict[str, list[float]] = {option: [] for option in runs}
    forwards: dict[str, list[float]] = {option: [] for option in runs}
    for round_ in range(repeats + 1):
        for option, run in runs.items():
            inputs_args, inputs_kwargs = tree_map(fresh, (args, kwargs))
            for p in params:  # as after zero_grad(set_to_none=True): backward makes, not adds
                p.grad = None
            start = now()
            out = run(*inputs_args, **inputs_kwargs)
            forward = now() - start
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            if round_:  # round 0 warms up
                samples[option].append(now() - start)
                forwards[option].append(forward)
            del out, outputs, inputs_args, inputs_kwargs
    for p in params:
        p.grad = None
    return ({option: statistics.median(s) for option, s in samples.items()},
            {option: statistics.median(s) for option, s in forwards.items()})


def fresh(x: Any) -> Any:
    """A floating-point input as in training: it wants its gradient. A copy of a fresh leaf, not the
    leaf: a layer may write into its input in place (autograd refuses that on a leaf), and must
    not write into the real one, which the no-grad forward goes on with. Other inputs as they are."""
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_(True).clone()
    return x


def layer_kind(module: nn.Module) -> tuple:
    """What a layer's time depends on besides its inputs: its class and its parameters' shapes."""
    return (type(module).__qualname__,
            *((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()))


def input_signature(tree: Any) -> Iterator[tuple]:
    """What a layer's time depends on in its inputs: each tensor's shape, dtype, device; other values as such."""
    pairs, _spec = tree_flatten_with_path(tree)
    for path, leaf in pairs:
        if isinstance(leaf, torch.Tensor):
            yield keystr(path), tuple(leaf.shape), leaf.dtype, leaf.device.type
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            yield keystr(path), leaf
        else:
            yield keystr(path), type(leaf).__qualname__


def synchronized(model: nn.Module, clock: Callable[[], float]) -> Callable[[], float]:
    """``clock``, reading it only once the accelerator has finished, when the model is on one."""
    if {t.device.type for t in (*model.parameters(), *model.buffers())} <= {"cpu", "meta"}:
        return clock

    def now() -> float:
        torch.accelerator.synchronize()
        return clock()

    return now


__all__ = ["fresh", "input_signature", "layer_kind", "synchronized", "time_calls"]

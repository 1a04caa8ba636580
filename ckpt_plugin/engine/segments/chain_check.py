"""Whether the layers ``ckpt.segments`` spans form a chain: one rule, checked where the layers sit and where they run.

A segment is recomputed from its first input alone (``chain.py``): layer
``k+1`` must take layer ``k``'s output and the same other arguments as layer
``k``. Two checks, one rule (issue #20):

- **Where the layers sit** (:func:`check_chain`, from ``wrap.check_plan``:
  before anything runs). Each layer is a child of an ``nn.Sequential`` or
  ``nn.ModuleList``, the layers under one parent are consecutive children, and
  a chain runs on from one list into another only where the data flow is the
  containers' own: from the last child of one list into the first child of the
  next, the two lists (or the containers holding them, through further ones)
  consecutive children of an ``nn.Sequential`` or ``nn.ModuleList``. That keeps
  the Bottlenecks of consecutive ResNet stages one chain; an encoder's layer
  list and a decoder's, joined by the model's own ``forward``, are two. A
  ``ModuleList`` holds no forward, so as for the layers themselves its parent
  is taken to call its children in order; the call check below confirms it.
- **What the layers get** (:class:`Links`): each call's first argument must be
  the very tensor the previous layer returned and its other arguments the
  previous layer's. ``ChainCheckpoint`` asks on every call inside a segment
  and raises before a wrong gradient can exist; ``apply/plan.py`` asks, with
  :func:`watching`, on every call of one forward of the sample input on fake
  tensors, so that layers returning tuples or taking other arguments are a
  ``ConfigError`` when segments are applied, not a crash at the first step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import version
from ckpt_plugin.engine.side_effects import without_cache
from ckpt_plugin.errors import Problem

STACKS = (nn.Sequential, nn.ModuleList)  # containers whose children run in their order
NO_SEGMENTS = "set ckpt.segments=null to checkpoint each layer"


# -- what each layer gets: the check every call goes through ----------------------------------


def same_arguments(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same arguments: the very same objects, or equal plain values
    (containers compared item by item), so a replay with ``b`` computes what the call with ``a`` did."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(same_arguments, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_arguments(a[k], b[k]) for k in a)
    if isinstance(a, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return a == b
    return False


class Links:
    """What the last layer of a chain took and returned, and whether a call continues from it."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.index = -1  # the layer that returned last
        self.output: Any = None
        self.version = 0  # the output's in-place write counter as it was returned
        self.rest: tuple[tuple, dict] = ((), {})  # the last layer's arguments after its first

    def took(self, args: tuple, kwargs: dict) -> None:
        self.rest = (args[1:], kwargs)

    def returned(self, i: int, output: Any) -> None:
        self.index, self.output = i, output
        self.version = version(output) if isinstance(output, torch.Tensor) else 0

    def release(self) -> None:
        """Drop the tensors held: kept until the next forward, they would keep this step's graph alive."""
        self.output, self.rest = None, ((), {})

    def why_not(self, i: int, args: tuple, kwargs: dict) -> str | None:
        """How layer ``i``'s call does not continue the chain (``"got a different value"``); None: it does."""
        rest, kw = self.rest
        previous = self.names[i - 1]
        if self.index != i - 1:
            return f"was called after {self.names[self.index]}" if self.index >= 0 else "was called first"
        if not args or args[0] is not self.output or not isinstance(args[0], torch.Tensor):
            return _instead(args[0] if args else None, self.output)
        if version(args[0]) != self.version:  # the caller wrote into it (x.mul_(s)): a replay would not
            return f"got that output written in place after {previous} returned it"
        if len(args) != len(rest) + 1:
            return f"got {len(args)} positional arguments, {previous} {len(rest) + 1}"
        if not same_arguments(args[1:], rest):
            return f"got other positional arguments after the first than {previous}"
        if kwargs.keys() != kw.keys():
            return f"got the keyword arguments {sorted(kwargs)}, {previous} {sorted(kw)}"
        if not same_arguments(kwargs, kw):
            differ = [k for k in kwargs if not same_arguments(kwargs[k], kw[k])]
            return f"got other values than {previous} for the keyword arguments {differ}"
        return None


def _instead(first: Any, output: Any) -> str:
    """What a layer got instead of the previous layer's output: a part of it, or something else."""
    if first is not None and first is output:
        return f"got that output itself, a {type(output).__name__}, not one tensor"
    if first is not None and isinstance(output, (tuple, list)):
        for k, item in enumerate(output):
            if item is first:
                return f"got item {k} of that output, a {type(output).__name__} of {len(output)}"
    if first is not None and isinstance(output, Mapping):
        for key, item in output.items():
            if item is first:
                return f"got the value of {key!r} in that output, a {type(output).__name__}"
    return "got a different value"


def not_a_chain(later: str, earlier: str, got: str, when: str = "") -> str:
    """The sentence both call checks start with (``tests/test_properties.py`` matches its shape)."""
    return (f"ckpt.segments: {later} did not take {earlier}'s output as its one input (it {got}){when}, "
            f"so these layers are not a chain and a segment cannot be recomputed from its first input")


@contextlib.contextmanager
def watching(model: nn.Module, names: list[str]) -> Iterator[list[tuple[int, str]]]:
    """Check every call of the layers ``names`` of ``model`` while the caller runs a forward.

    Yields the breaks found, ``(i, what layer i got)``, in call order. Every call
    after the first layer's is checked, not only those inside a segment as
    ``ChainCheckpoint`` does, so the answer does not depend on ``ckpt.segments``'
    value. The arguments are seen as a checkpointed training call gets them
    (no KV cache, ``use_cache=False``). Only hooks are added, and removed on exit.
    """
    links, breaks = Links(names), []
    handles = []

    def pre(i: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            args, kwargs = without_cache(args, kwargs)
            got = links.why_not(i, args, kwargs) if i > 0 else None
            if got is not None:
                breaks.append((i, got))
            links.took(args, kwargs)

        return hook

    def post(i: int):
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            links.returned(i, output)

        return hook

    try:
        for i, name in enumerate(names):
            layer = model.get_submodule(name)
            handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(post(i), always_call=True))
        yield breaks
    finally:
        for handle in handles:
            handle.remove()
        links.release()


def call_problem(model: nn.Module, names: list[str], breaks: list[tuple[int, str]]) -> Problem:
    """The first break a forward of ``model``'s sample input found (``breaks`` from :func:`watching`)."""
    i, got = breaks[0]
    where = f" in a forward of {type(model).__name__} on its sample input"
    runs = _split(names, [b for b, _ in breaks])
    return Problem("ckpt.segments", not_a_chain(names[i], names[i - 1], got, where),
                   "segments need layers that feed each other one tensor and all get the same other arguments: "
                   + _choices(model, runs))


# -- where the layers sit: the check before anything runs -------------------------------------


def check_chain(model: nn.Module, names: list[str]) -> list[Problem]:
    """Problems that keep ``names`` from being one chain, from where they sit in ``model`` (empty: none).

    Each layer's parent must be an ``nn.Sequential`` or ``nn.ModuleList`` and the
    layers under one parent consecutive children; where the chain passes from
    one parent to the next, :func:`_seam` says whether the containers carry the
    data across. Whether each layer really gets the previous one's output is
    checked on the calls (:class:`Links`).
    """
    problems: list[Problem] = []
    by_parent: dict[str, list[str]] = {}
    for name in names:
        by_parent.setdefault(_parent(name), []).append(name)
    for parent_name, group in by_parent.items():
        parent = model.get_submodule(parent_name)
        where = parent_name or "the model"
        if not isinstance(parent, STACKS):
            problems.append(Problem(
                "ckpt.segments",
                f"ckpt.segments: {', '.join(group)} {'is a child' if len(group) == 1 else 'are children'} of "
                f"{where} ({type(parent).__name__}), not of "
                f"an nn.Sequential or nn.ModuleList, so the order they run in is unknown",
                "select blocks of a Sequential/ModuleList, or set ckpt.segments=null",
            ))
            continue
        children = _children(model, parent_name)
        start = children.index(group[0])
        if children[start : start + len(group)] != group:
            problems.append(Problem(
                "ckpt.segments",
                f"ckpt.segments: {', '.join(group)} are not consecutive children of {where}",
                "select a run of consecutive blocks (ckpt.every_n cannot be combined with segments)",
            ))
    if problems:
        return problems
    seams = [(k, _seam(model, a, b)) for k, (a, b) in enumerate(pairwise(names), 1) if _parent(a) != _parent(b)]
    breaks = [(k, why) for k, why in seams if why is not None]
    if not breaks:
        return []
    k, why = breaks[0]
    a, b = names[k - 1], names[k]
    return [Problem(
        "ckpt.segments",
        f"ckpt.segments: the {len(names)} selected layers are not one chain: {b} comes after {a} but in another "
        f"list, and {why}, so nothing says {b} takes {a}'s output",
        "segments run over one chain: " + _choices(model, _split(names, [k for k, _ in breaks])),
    )]


def _seam(model: nn.Module, a: str, b: str) -> str | None:
    """Why layer ``a``'s output need not be layer ``b``'s input, ``b`` under another parent; None: it is.

    Up from ``a``, each module must be the last child of a container; up from
    ``b``, the first; where the two paths meet, they must be consecutive children of a container.
    """
    pa, pb = a.split("."), b.split(".")
    depth = 0  # how many leading name parts the two paths share: they meet in the module so named
    while depth < min(len(pa), len(pb)) and pa[depth] == pb[depth]:
        depth += 1
    meet = ".".join(pa[:depth])
    for path, end in ((pa, "last"), (pb, "first")):
        for k in range(len(path), depth + 1, -1):  # from the layer up to, not into, the meeting point's child
            node, parent = ".".join(path[:k]), ".".join(path[: k - 1])
            module = model.get_submodule(parent)
            if not isinstance(module, STACKS):
                kind = type(module).__name__
                return f"{node} is a child of {parent} ({kind}), not of an nn.Sequential or nn.ModuleList"
            children = _children(model, parent)
            at = children.index(node)
            if end == "last" and at != len(children) - 1:
                return f"{node} is not the last child of {parent} ({children[at + 1]} follows it)"
            if end == "first" and at != 0:
                return f"{node} is not the first child of {parent} ({children[at - 1]} precedes it)"
    container = model.get_submodule(meet)
    x1, x2 = ".".join(pa[: depth + 1]), ".".join(pb[: depth + 1])
    lists, where = f"{_parent(a)} and {_parent(b)}", meet or "the model"
    if not isinstance(container, STACKS):
        return f"{lists} meet in {where} ({type(container).__name__}), not in an nn.Sequential or nn.ModuleList"
    children = _children(model, meet)
    between = children[children.index(x1) + 1 : children.index(x2)]
    if between:
        run = "run" if len(between) > 1 else "runs"
        return f"{lists} meet in {where}, where {', '.join(between)} {run} between {x1} and {x2}"
    return None


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _children(model: nn.Module, parent: str) -> list[str]:
    return [f"{parent}.{k}" if parent else k for k, _ in model.get_submodule(parent).named_children()]


def _split(names: list[str], starts: list[int]) -> list[list[str]]:
    """``names`` cut before each index in ``starts``: the runs that may each be one chain."""
    cuts = [0, *sorted(set(starts)), len(names)]
    return [names[i:j] for i, j in pairwise(cuts) if j > i]


def _choices(model: nn.Module, runs: list[list[str]]) -> str:
    """``select one, ckpt.layers='enc.layers.*' or ckpt.layers='dec.layers.*', or set ckpt.segments=null ...``:
    the runs of two or more layers left between the breaks, each a chain as far as the checks could see."""
    selectors = [f"ckpt.layers={_selector(model, run)!r}" for run in runs if len(run) > 1]
    if len(selectors) > 1:
        return f"select one, {' or '.join(selectors)}, or {NO_SEGMENTS}"
    return f"{selectors[0]}, or {NO_SEGMENTS}" if selectors else NO_SEGMENTS


def _selector(model: nn.Module, run: list[str]) -> str | list[str]:
    """A ``ckpt.layers`` value selecting exactly ``run``: ``'parent.*'`` when it is all of one list's children."""
    parent = _parent(run[0])
    if parent and all(_parent(n) == parent for n in run) and run == _children(model, parent):
        return f"{parent}.*"
    return run


__all__ = ["Links", "call_problem", "check_chain", "not_a_chain", "same_arguments", "watching"]

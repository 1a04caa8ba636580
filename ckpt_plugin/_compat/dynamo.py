"""``torch.compile``'s internals (``torch._dynamo``, ``torch._functorch``, private): whether a trace is
running, the memory budget of its partitioner, its backends, its failures and its recompile limit."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def tracing_for_compile() -> bool:
    """Whether AOTAutograd is tracing right now (torch.compile, export), as torch's checkpoint
    itself decides it (``torch.utils.checkpoint._is_compiling``: a proxy dispatch mode is
    active); it then accepts only torch's own selective-checkpoint modes from ``context_fn``."""
    non_strict = getattr(torch.compiler, "_is_non_strict_tracing", None)  # new in torch 2.12; 2.11 has none
    if non_strict is not None and non_strict():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


# -- for torch's own memory-budget checkpointing under compile (ckpt_tools/compiled.py) --

def activation_memory_budget(budget: float) -> Any:
    """Context manager: ``torch._functorch.config.activation_memory_budget = budget`` while in force.

    AOTAutograd's min-cut partitioner reads it when it partitions a compiled
    graph (the first run of a frame, or a recompile), not when the graph runs:
    ``1.0`` (torch's default) saves what is fastest, ``0.0`` recomputes all it
    can, ``0.5`` aims at half of what ``1.0`` keeps beyond the graph's inputs,
    at the fewest recomputed FLOPs. Private config module, no public setter; torch 2.13
    also has ``torch.autograd.graph.region_activation_memory_budget`` (prototype),
    which annotates a traced region instead.
    """
    from torch._functorch import config  # private

    return config.patch(activation_memory_budget=budget)


def compiler_backend(name: str) -> Any:
    """The ``torch.compile`` backend registered as ``name`` (``"inductor"``, ``"aot_eager"``), as a callable.

    ``torch.compile(backend=name)`` looks it up itself; we need the callable to
    wrap it in a backend object of our own (dynamo keeps one compiled frame per
    backend, see ``ckpt_tools/compiled.py``). Lookup is ``torch._dynamo``'s (private).
    """
    from torch._dynamo.backends.registry import lookup_backend  # private

    return lookup_backend(name)


# -- for ckpt.compile's compiled calls (engine/regional.py) --

def compile_failures() -> tuple[type[BaseException], ...]:
    """What ``torch.compile(fn, fullgraph=True)`` raises when ``fn`` does not compile as one graph:
    dynamo's ``Unsupported`` (a graph break) and ``FailOnRecompileLimitHit`` (one graph past
    ``recompile_limit``). Private module ``torch._dynamo.exc``, no public names for them."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported  # private

    return (Unsupported, FailOnRecompileLimitHit)


def recompile_limit_hit(err: BaseException) -> bool:
    """Whether ``err`` (one of :func:`compile_failures`) is the recompile limit, not a graph break."""
    from torch._dynamo.exc import FailOnRecompileLimitHit  # private

    return isinstance(err, FailOnRecompileLimitHit)


@functools.cache
def _compile_takes_recompile_limit() -> bool:
    return "recompile_limit" in inspect.signature(torch.compile).parameters


def compile_with_recompile_limit(fn: Any, backend: str, fullgraph: bool, limit: int) -> Any:
    """``torch.compile(fn, backend=backend, fullgraph=fullgraph)`` that compiles at most ``limit`` graphs for
    ``fn`` (past it, with ``fullgraph``, a call raises ``FailOnRecompileLimitHit``), whatever the global
    ``torch._dynamo.config.recompile_limit``.

    torch 2.13 and 2.15: ``torch.compile`` takes ``recompile_limit=`` and patches the (private) dynamo config
    with it while it compiles a frame of this call (``ConvertFrameAssert``). torch 2.11: no such keyword
    (``TypeError: compile() got an unexpected keyword argument``), and dynamo reads only the global
    ``config.recompile_limit`` (``cache_size.exceeds_recompile_limit``): the returned function patches it the
    same way around each call, which is when dynamo compiles. The config is ``compile_ignored`` (no guard,
    no cache key depends on it). Traced by an outer ``torch.compile`` (a compiled model over compiled layers),
    the call is inlined into the outer graph, as on 2.13, so no patch is made there.
    """
    if _compile_takes_recompile_limit():
        return torch.compile(fn, backend=backend, fullgraph=fullgraph, recompile_limit=limit)
    from torch._dynamo import config as dynamo_config  # private

    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        with dynamo_config.patch(recompile_limit=limit):
            return compiled(*args, **kwargs)

    return limited


def recompile_limit() -> int:
    """``torch._dynamo.config.recompile_limit``: how many graphs dynamo keeps per code object (private config)."""
    import torch._dynamo  # private

    return torch._dynamo.config.recompile_limit


def forget_compiled(fn: Any) -> None:
    """Drop every graph dynamo compiled for ``fn``'s code object (private): a function of ours compiled
    once per plan would otherwise keep each plan's graphs, and guards, for the life of the process."""
    import torch._dynamo.eval_frame  # private

    torch._dynamo.eval_frame.reset_code(fn.__code__)

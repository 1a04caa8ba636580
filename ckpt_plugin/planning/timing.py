"""What each option of each candidate layer adds to the step time, measured one layer at a time.

    times = measure_layer_times(model, names, forward, {o: treatment(o) for o in OPTIONS})
    times.predicted_seconds({"blocks.0": FULL, "blocks.1": SELECTIVE})  # the step, in seconds

Users pay step time, not FLOPs: a selective recomputation of a GPT block
recomputes few FLOPs but memory-bound ops (GELU, LayerNorm, dropout masks), and
the same FLOPs cost more in a convolution than in a matmul. So we time every
option, on the real tensors, without ever running the step the user cannot
afford (checkpointing is on because the un-checkpointed step does not fit):

1. One ``forward()`` under ``torch.no_grad()``, with a forward pre-hook on every
   candidate. In the hook, the layer's real inputs become fresh leaves (copied:
   a write in place must not reach the real ones) and each option runs
   forward + backward (recomputation included) under
   ``enable_grad``: one untimed warm-up, then ``repeats`` timed rounds taken in
   turn over the options (so a slow spell of the shared machine hits all
   options alike), keeping the median. The outer forward then goes on holding
   nothing: the memory in use is one layer's activations, never the step's.
2. One real step (``forward()`` + backward) with every candidate checkpointed
   ``full``, the plan using the least memory, timed (the layers are warm by then):
   ``full_step_seconds``. Any other plan's step is predicted from it:
   ``full_step_seconds - sum(added(full)) + sum(added(chosen))``.

Compiled (``compiled=``, ``ckpt.timing``): under ``torch.compile`` a recomputation
is fused into the backward's kernels and costs a fraction of its eager time (on
the example GPT, CPU inductor: ``full`` on every block +8 % compiled, +50 %
eager; issue #22), so a plan timed eagerly over-prices recomputation and under-
prices keeping. Each option the step compiles is timed compiled, the layer's
call through ``torch.compile(fullgraph=True)`` with its checkpoint inside, as
``ckpt.compile`` runs it (``engine/regional.py``); alike layers share one graph
per option, compiled in the untimed warm-up round.

Each option's time is the median of ``repeats`` interleaved calls (``clock.py``
says why the median). How well the predictions hold against real steps of
installed plans (``python -m ckpt_tools.evaluate_timing``) is in
``docs/bench/timing.md``.

RuntimeEstimator (``torch.distributed._tools.runtime_estimator``) would need no
memory, but it does not run on CPU, and it sums the ops' own times, missing
what checkpointing costs around them (the selective policy's dispatch mode,
checkpoint's bookkeeping), so it ranks ``selective`` cheaper than ``full``
where it is not (``docs/bench/timing.md``). The measured times stay; the cost
is one forward, ``3 x (repeats + 1)`` runs of each *kind* of layer (alike
blocks are timed once) and ``step_repeats`` steps with every layer ``full``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import forget_compiled, tree_leaves, tree_map
from ckpt_plugin.engine.forwards import TemporaryForwards
from ckpt_plugin.engine.regional import CompiledCalls
from ckpt_plugin.engine.side_effects import without_cache
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import CheckpointedForward, checkpointing_disabled
from ckpt_plugin.measure.memory import SavedCounter, side_effect_free
from ckpt_plugin.planning.clock import fresh, input_signature, layer_kind, synchronized, time_calls
from ckpt_plugin.planning.layer_times import LayerTimes, TimingCache
from ckpt_plugin.planning.options import FULL, KEEP, Option

log = logging.getLogger("ckpt_plugin")


def measure_layer_times(
    model: nn.Module,
    names: list[str],
    forward: Callable[[], Any],
    options: Mapping[Option, Treatment | None],
    *,
    repeats: int = 3,
    step_repeats: int = 1,
    cache: TimingCache | None = None,
    clock: Callable[[], float] = time.perf_counter,
    compiled: Mapping[Option, str] | None = None,
    parts: Mapping[str, Collection[Option]] | None = None,
    whole_step: bool = False,
    layer_options: Mapping[str, Collection[Option]] | None = None,
) -> LayerTimes:
    """Time every option of every candidate layer (qualified names) on real inputs, one layer at a time.

    ``forward()`` runs the model on its sample batch and returns the loss.
    ``options`` maps each option to how a layer runs under it (``None``: not
    wrapped); it must name ``keep`` (None) and ``full``. The planner passes its
    own (``{o: profile.treatment(o) for o in OPTIONS}``), so that this module
    imports nothing of the planner's.

    ``cache``: a dict the caller keeps (one per model) to skip timing a layer
    again on inputs it has seen: keyed by (option, the layer's class and
    parameter shapes, the inputs' shapes, dtypes, devices and non-tensor
    values); the value is the seconds of one call. Alike layers share one
    timing: a layer called twice on alike inputs in one step, or twelve alike
    blocks, are timed once. The step with every layer ``full`` runs each time,
    ``step_repeats`` times (the layers are warm by then).

    ``clock``: seconds now; wall-clock by default (what a step costs). On a
    CPU shared with other processes, ``time.process_time`` with one intra-op
    thread counts only this process's work (``ckpt_tools/evaluate_timing.py``).

    ``compiled``: option -> the ``torch.compile`` backend that option runs
    through in the step being planned; the others run eagerly. Each such
    option is timed as ``ckpt.compile`` runs a layer (``regional.py``): the
    layer's call compiled with ``fullgraph=True``, its checkpoint included, so
    the recomputation is timed fused into the compiled backward, as it will
    run. One set of compiled calls per option serves every layer (alike blocks
    share one graph) and the untimed warm-up round compiles. The whole
    measurement runs with ``torch.compiler.set_stance("force_eager")``, so
    layers or a model the user compiled run their hooks eagerly, and only our
    own calls compile. A compiled call keeps other bytes for backward than the
    eager one (the partitioner saves what it chooses, fused): ``kept_bytes``
    has, per layer and compiled option, what its compiled call saves (counted
    through ``saved_tensors_hooks``, each storage once, parameters excluded,
    the layer's inputs included as the profile counts them), from one more
    untimed call.

    ``parts``: modules inside the layers (``inside.py``) -> the options to time
    each under (``keep`` always). Each is timed as a layer is, on its real
    inputs in the same no-grad forward (never inside the timing of its layer),
    alike parts once; they take no part in the step with every layer ``full``.

    ``layer_options``: layer -> the options to time it under, where fewer than ``options``
    (``keep`` always): a layer that cannot run under a selective policy (``profile.py``).

    ``whole_step`` (with ``keep`` compiled: the whole step will run compiled, the
    model compiled by the user): also what the rest of the model keeps in that
    compiled step, with every layer ``full``, as ``compiled_rest_bytes``. The
    layers' compiled calls cannot show it: compiled whole, the partitioner sees
    across the layers, and one constant that CSE merges from every layer's
    region into the first (the zero attention bias of SDPA's decomposition:
    (B, heads, T, T), 8 MiB on the example GPT) is used by later regions, so
    torch saves it (``cleanup_recompute_tags`` saves a recomputable node whose
    user is in a later region), outside every layer. The step is traced and
    partitioned once, through ``aot_eager_decomp_partition`` for inductor (its
    decompositions and partitioner, no code generated), the backend itself for
    another.

    Leaves no trace: RNG streams, buffers (BatchNorm statistics), every
    parameter's ``.grad`` and every module's ``forward`` (a model already wrapped
    is measured unwrapped and gets its very wrappers back) are as they were.
    """
    if repeats < 1 or step_repeats < 1:
        raise ValueError(f"repeats={repeats} and step_repeats={step_repeats} must be at least 1")
    if KEEP not in options or options[KEEP] is not None or options.get(FULL) is None:
        raise ValueError("options must map 'keep' to None and 'full' to a Treatment; got "
                         f"{ {str(o): t for o, t in options.items()} }")
    names = list(dict.fromkeys(names))
    check_candidates(model, names)
    modules = dict(model.named_modules())
    parts = {name: [o for o in options if o == KEEP or o in timed] for name, timed in (parts or {}).items()}
    wrong = [name for name in parts if name not in modules or name in names]
    if wrong:
        raise ValueError(f"parts {', '.join(map(repr, wrong))}: not modules of {type(model).__name__} apart from the layers")
    seconds = {name: dict.fromkeys(options, 0.0) for name in names} | {n: dict.fromkeys(o, 0.0) for n, o in parts.items()}
    kept = {name: dict.fromkeys(compiled or {}, 0) for name in [*names, *parts]}
    forward_seconds: dict[str, float] = {}  # layer -> its forward under keep, summed over calls
    cache = {} if cache is None else cache
    compiled = dict(compiled or {})
    unknown = sorted(set(compiled) - set(options))
    if unknown:
        raise ValueError(f"compiled names {', '.join(repr(str(o)) for o in unknown)}, not options: "
                         f"{', '.join(map(str, options))}")
    runs = _Runs(options, compiled, len(names) + len(parts))
    now = synchronized(model, clock)
    grads = {p: p.grad for p in model.parameters()}
    try:
        with side_effect_free(model), checkpointing_disabled(model), _eager_unless_ours(compiled):
            timed = {name: [o for o in options if o == KEEP or o in (layer_options or {}).get(name, options)]
                     for name in names} | parts
            _time_layers(modules, timed, forward, runs, repeats, cache, seconds, kept, now, forward_seconds)
            full_step = _time_full_step(modules, names, forward, runs, step_repeats, now)
            rest = None
            if whole_step and KEEP in compiled:
                total = _whole_step_bytes(modules, names, forward, options[FULL], compiled[KEEP])
                rest = None if total is None else max(total - sum(kept[name][FULL] for name in names), 0)
    finally:
        for p, g in grads.items():
            p.grad = g
    return LayerTimes(seconds, full_step, compiled, kept if compiled else {}, tuple(parts), rest, forward_seconds)


class _Runs:
    """How a layer runs under each option when timed: eagerly, or through compiled calls of our own."""

    def __init__(self, options: Mapping[Option, Treatment | None], compiled: Mapping[Option, str], layers: int) -> None:
        self.options, self.compiled = options, compiled
        full = options[FULL]
        # One set of compiled calls per option, shared by every layer: alike layers share one graph.
        # ``keep`` compiled is the layer's call compiled without a checkpoint (CompiledCalls.uncheckpointed).
        self.calls = {o: CompiledCalls(backend, options[o] or full, layers) for o, backend in compiled.items()}
        self.kept: dict[tuple, int] = {}  # (option, signature) -> bytes a compiled call keeps (alike layers: once)

    def key(self, option: Option) -> str:
        """The option as the timing cache names it: ``full``, or ``full compiled (inductor)``."""
        backend = self.compiled.get(option)
        return str(option) if backend is None else f"{option} compiled ({backend})"

    def of(self, option: Option, module: nn.Module, name: str) -> Callable[..., Any]:
        treatment, calls = self.options[option], self.calls.get(option)
        if calls is None:
            return module.forward if treatment is None else CheckpointedForward(module, treatment, name)
        if treatment is None:
            inner = module.forward
            return _ours(lambda *args, **kwargs: calls.uncheckpointed(inner, args, kwargs, name))
        return _ours(CheckpointedForward(module, treatment, name, compiled=calls))


def _eager_unless_ours(compiled: Mapping[str, str]) -> contextlib.AbstractContextManager:
    """While timing compiled options: what the user compiled runs eagerly (hooks included), see ``_ours``."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def _ours(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with torch.compile's default stance: our compiled calls compile inside ``_eager_unless_ours``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("default"):
            return run(*args, **kwargs)

    return call


def _time_layers(modules: dict[str, nn.Module], timed: dict[str, list[Option]], forward: Callable[[], Any],
                 runs: _Runs, repeats: int, cache: TimingCache, seconds: dict[str, dict[Option, float]],
                 kept: dict[str, dict[Option, int]], now: Callable[[], float],
                 forward_seconds: dict[str, float]) -> None:
    """Step 1: a no-grad forward whose pre-hooks time each candidate (layer or part) on its real inputs (and the
    forward of each under ``keep`` alone, into ``forward_seconds``)."""
    busy = []  # while a layer is timed, the hooks of its parts do nothing

    def pre(module: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        if busy:
            return
        busy.append(name)
        try:
            _time_one(module, args, kwargs, name)
        finally:
            busy.pop()

    def _time_one(module: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        # Alike layers (the blocks of a transformer) are timed once: same class, same parameter
        # shapes, same inputs; a stack of twelve blocks costs one block's timing.
        args, kwargs = without_cache(args, kwargs)  # each timed run must not add to the model's KV cache
        signature = (layer_kind(module), module.training, *input_signature((args, kwargs)))
        todo = [o for o in timed[name] if (runs.key(o), signature) not in cache]
        if todo:
            calls = {o: runs.of(o, module, name) for o in todo}
            with torch.enable_grad():
                times, forwards = time_calls(calls, args, kwargs, list(module.parameters()), repeats, now)
            cache.update({(runs.key(o), signature): s for o, s in times.items()})
            if KEEP in forwards:  # the forward alone of the layer as it is: what offload's copies out hide behind
                cache[(f"{runs.key(KEEP)} forward", signature)] = forwards[KEEP]
        for option in timed[name]:
            seconds[name][option] += cache[(runs.key(option), signature)]
        forward_seconds[name] = forward_seconds.get(name, 0.0) + cache[(f"{runs.key(KEEP)} forward", signature)]
        for option in [o for o in runs.compiled if o in timed[name]]:
            if (option, signature) not in runs.kept:
                with torch.enable_grad():
                    runs.kept[(option, signature)] = _kept_bytes(runs.of(option, module, name), module, args, kwargs)
            kept[name][option] += runs.kept[(option, signature)]

    handles = [modules[name].register_forward_pre_hook(
        lambda m, a, k, name=name: pre(m, a, k, name), with_kwargs=True) for name in timed]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()


def _kept_bytes(run: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes one call of ``run`` keeps for backward: what it saves (each storage once, the module's
    parameters and buffers excluded) and its inputs, which every option holds (``recorder.py``)."""
    counter = SavedCounter(module)
    inputs_args, inputs_kwargs = tree_map(fresh, (args, kwargs))
    for t in tree_leaves((inputs_args, inputs_kwargs)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            counter.add(t)
    with counter.hooks():
        out = run(*inputs_args, **inputs_kwargs)
    del out
    return counter.result.total


def _time_full_step(modules: dict[str, nn.Module], names: list[str], forward: Callable[[], Any],
                    runs: _Runs, repeats: int, now: Callable[[], float]) -> float:
    """Step 2: median seconds of ``repeats`` real steps (forward and backward) with every candidate ``full``."""
    params = list(modules[""].parameters())
    samples = []
    with TemporaryForwards([(modules[name], runs.of(FULL, modules[name], name)) for name in names]):
        for step in range(repeats):
            for p in params:
                p.grad = None
            start = now()
            with torch.enable_grad():
                outputs = [t for t in tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outputs:
                    raise ValueError("measure_layer_times: forward() returned no tensor that requires grad; "
                                     "it must return the loss")
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            samples.append(now() - start)  # the layers warmed up in step 1
            del outputs
    return statistics.median(samples)


PARTITION_ONLY = {"inductor": "aot_eager_decomp_partition"}  # a backend -> one that partitions alike, generating no code


def _whole_step_bytes(modules: dict[str, nn.Module], names: list[str], forward: Callable[[], Any],
                      full: Treatment, backend: Any) -> int | None:
    """Bytes the forward keeps for backward with the whole step compiled through ``backend``'s partition and
    every layer ``full`` (wrapped eagerly, as the plugin installs it under a user's torch.compile); None when
    it does not compile (the plan then counts the rest's eager bytes)."""
    counter = SavedCounter(modules[""])
    try:
        with TemporaryForwards([(modules[name], CheckpointedForward(modules[name], full, name)) for name in names]):
            compiled = torch.compile(_whole, backend=PARTITION_ONLY.get(backend, backend))
            with torch.compiler.set_stance("default"), torch.enable_grad(), counter.hooks():
                out = compiled(forward)
            del out
        return counter.result.total
    except Exception as err:  # noqa: BLE001 -- an estimate: without it the plan counts the rest eagerly
        log.debug("ckpt=auto: the whole step did not compile for its rest's bytes (%s: %s)", type(err).__name__, err)
        return None
    finally:
        forget_compiled(_whole)


def _whole(forward: Callable[[], Any]) -> Any:
    """The step's forward, as :func:`_whole_step_bytes` compiles it (a code object of ours, forgotten after)."""
    return forward()


def check_candidates(model: nn.Module, names: list[str]) -> None:
    """``ckpt=auto``'s candidates: at least one, each a module of ``model``, none inside another."""
    if not names:
        raise ValueError("ckpt=auto: nothing to choose from: ckpt.layers selected no layers; name the "
                         "repeated blocks of the model, e.g. ckpt.layers=TransformerBlock")
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"ckpt=auto: no module named {', '.join(map(repr, missing))} in {type(model).__name__}")
    nested = [(a, b) for a in names for b in names if a != b and (a == "" or b.startswith(a + "."))]
    if nested:
        raise ValueError(f"ckpt=auto: ckpt.layers selected {nested[0][1]!r} inside {nested[0][0] or 'the model'!r}; "
                         "the candidate layers must not contain one another")


__all__ = ["LayerTimes", "TimingCache", "check_candidates", "measure_layer_times"]

"""How a module gets wrapped: :func:`install` puts a plan on a model, :func:`remove_checkpointing` takes it off.

Every mode ends here. A :class:`~ckpt_plugin.engine.plan.WrapPlan` (from
``apply/plan.py`` for a config, from the planner for ``ckpt=auto``) lists
groups of modules by qualified name, each with a ``Treatment``: one checkpoint
per module (:class:`CheckpointedForward`, below) or segments over a chain
(``segments/chain.py``). :func:`install` checks the whole plan against the model, then
removes any earlier wrapping and installs, so an error leaves the model as it was.

A selected module keeps its place, its class and its name: we set an
instance-level ``forward`` (through ``forwards.py``, the one module that writes
it) that runs the class's own forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. ``nn.Module``
looks ``forward`` up on the instance first, so hooks, ``state_dict`` keys and
``named_parameters`` stay exactly as they were, unlike torch's
``checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module`` into every
key (pytorch#117399, pytorch#108269). Removing the attribute restores the
module exactly.

Recomputation replays the forward, and a BatchNorm in training mode would
update its running statistics a second time (pytorch#96136, open upstream).
The recompute context below snapshots every running-statistics buffer in the
wrapped subtree and writes it back afterwards, so statistics match a run
without checkpointing bit for bit.

Arguments are the other side effect: a Hugging Face KV cache would be filled
again by the recomputation, and any mutable argument changed twice. Each call
goes through ``side_effects.py`` first (one :class:`SideEffects` per
:func:`install`): caches are neutralised in training as transformers' own
checkpointing does, with one warning, and a forward that changes an argument
raises at once (issue #14).

The recomputation must save what the forward saved; torch checks it. With
``ckpt.check_recompute=true`` or inside ``checking_recomputation()`` the error
also names the module (``recompute_check.py``), at a Python hook per saved tensor.

Under ``torch.compile``: apply, then compile, or compile, then apply. The
compiled code runs whatever ``forward`` each module has when it is traced,
and dynamo guards on it, so applying or removing after a compiled run
recompiles (``tests/test_compile.py``). With ``ckpt.compile`` (a plan's
``EachLayer.compile``) the checkpointed call of each layer is itself compiled
(``regional.py``), from the same instance-level ``forward``: removing it removes
the compiled call with it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ckpt_plugin._compat import checkpoint_debug_enabled, non_reentrant_checkpoint, user_module
from ckpt_plugin.engine.segments.chain import ATTR, ChainCheckpoint, chains_of
from ckpt_plugin.engine.segments.chain_check import check_chain
from ckpt_plugin.engine.forwards import TemporaryForwards, instance_forward, set_forward
from ckpt_plugin.engine.plan import Segments, WrapPlan
from ckpt_plugin.engine.regional import CompiledCalls
from ckpt_plugin.errors import raise_problems
from ckpt_plugin.engine.norms import running_stats
from ckpt_plugin.engine.offload_copies import Offloader
from ckpt_plugin.engine.op_groups import is_regrouped, regroup, regrouped, ungroup
from ckpt_plugin.engine.segments.sequential import schedule
from ckpt_plugin.engine.side_effects import SideEffects, remove_cache_hooks, turn_cache_off_above
from ckpt_plugin.engine.treatment import Treatment

class CheckpointedForward:
    """The instance-level ``forward`` of a wrapped module.

    ``inner`` is the forward the module had before (its class's, or an
    instance-level one somebody else set, which ``remove`` puts back).
    ``name`` is the module's qualified name, for errors: when the call is checked,
    a recomputation that saves something other than its forward did is reported
    with it (``recompute_check.py``). Unchecked, a module without a selective
    policy or BatchNorm statistics runs plain ``checkpoint(fn, *args, use_reentrant=False)``.
    ``side_effects`` is shared by the modules of one installation (a fresh one when not given).
    ``compiled``: the compiled calls the module's call goes through (``ckpt.compile``,
    ``regional.py``), shared by the modules of one treatment; None: eager.
    ``offloader``: where the treatment offloads, the installation's host pool and copy streams, shared
    by all its offloaded modules (``offload_copies.py``); None: the wrapper's own.
    """

    __slots__ = ("inner", "previous", "treatment", "name", "module", "label", "side_effects", "compiled",
                 "offloader", "_context_fn", "_checked_context_fn", "_stats")

    def __init__(self, module: nn.Module, treatment: Treatment, name: str | None = None,
                 side_effects: SideEffects | None = None, compiled: CompiledCalls | None = None,
                 offloader: Offloader | None = None) -> None:
        self.previous = instance_forward(module)  # None: the class's forward
        self.inner: Callable[..., Any] = module.forward
        self.treatment = treatment
        self.name = name
        self.module = module  # for its training flag (``inner`` holds it already)
        self.side_effects = side_effects or SideEffects()
        self.compiled = compiled
        self.offloader = offloader if offloader is not None or not treatment.offload else Offloader()
        self.label = f"{name} ({type(module).__name__})" if name else f"a {type(module).__name__}"
        self._stats = running_stats(module)
        self._context_fn = treatment.context_fn(self._stats, name=name)  # None: nothing of ours runs in the call
        self._checked_context_fn = treatment.context_fn(self._stats, self.label, name=name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = self.treatment
        with t.offloading(self.offloader):  # outside checkpoint: offloads what checkpointing still keeps
            if not t.checkpointing:
                if self.compiled is not None:
                    return self.compiled.uncheckpointed(self.inner, args, kwargs, self.label)
                return self.inner(*args, **kwargs)
            prepared = self.side_effects.prepare(self.module, self.inner, args, kwargs)
            if prepared is None:
                return self._checkpointed(args, kwargs)
            if prepared.uncheckpointed:
                return self.inner(*args, **kwargs)
            out = self._checkpointed(prepared.args, prepared.kwargs)
            prepared.check(self.label, self.inner, self.module.training)
            return out

    def _checkpointed(self, args: tuple, kwargs: dict) -> Any:
        t = self.treatment
        if t.checkpoint_fn is not None:  # another checkpoint implementation (DeepSpeed's)
            return t.checkpoint_fn(self.inner, self._stats, *args, **kwargs)
        if self.compiled is not None:  # ckpt.compile: the checkpointed call runs compiled
            return self.compiled.checkpointed(self.inner, args, kwargs, self.label)
        # kwargs travel in a partial so that a forward argument can never
        # collide with checkpoint's own keywords (``context_fn``, ...).
        fn = functools.partial(self.inner, **kwargs) if kwargs else self.inner
        context_fn = self._context_fn
        if t.checked():  # decided per call, as checking_recomputation() is scoped
            context_fn = self._checked_context_fn
            if self._context_fn is None and checkpoint_debug_enabled():
                # torch's debug mode refuses a context_fn and prints every op of both runs
                # on a mismatch: it replaces our check rather than fail.
                context_fn = None
        # ``is not None``, not truthiness: traced by torch.compile, torch 2.11's dynamo cannot take the truth of
        # a functools.partial (a graph break, "Data-dependent branching", FunctoolsPartialVariable); 2.13 and 2.15 can.
        options = {"context_fn": context_fn} if context_fn is not None else {}
        return non_reentrant_checkpoint(fn, *args, preserve_rng_state=t.preserve_rng_state, **options)


def wrapped_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that this plugin has wrapped."""
    model = user_module(model)
    return [
        n
        for n, m in model.named_modules()
        if isinstance(instance_forward(m), CheckpointedForward) or ATTR in m.__dict__
    ]


def policy_of(model: nn.Module) -> Any:
    """The selective policy the wrapped modules of ``model`` share, or None."""
    treatments = [w.treatment for m in model.modules() if isinstance(w := instance_forward(m), CheckpointedForward)]
    treatments += [chain.treatment for chain in chains_of(model)]
    return next((t.policy for t in treatments if t.policy is not None), None)


def offloaders_of(model: nn.Module) -> list[Offloader]:
    """The offloaders (host pool, copy streams) of the wrapped modules of ``model`` that offload, each once:
    one per installation (``install``)."""
    found = [w.offloader for m in model.modules()
             if isinstance(w := instance_forward(m), CheckpointedForward) and w.offloader is not None]
    found += [chain.offloader for chain in chains_of(model) if chain.offloader is not None]
    return list({id(o): o for o in found}.values())


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo :func:`apply_checkpointing`: every wrapped module gets its forward back, and a module whose
    forward ran as op groups (``op_groups.py``, ``ckpt=auto`` inside a layer) its own forward and children.

    Returns the qualified names that were unwrapped. Safe on a model that was
    never wrapped.
    """
    return _take_off(user_module(model), keep_groups=set())


def _take_off(model: nn.Module, keep_groups: set[int]) -> list[str]:
    """:func:`remove_checkpointing`, but the modules whose ids are in ``keep_groups`` keep their op groups
    (``install``: the plan it puts on runs them so)."""
    removed = wrapped_modules(model)
    remove_cache_hooks(model)
    offloaders = {id(o): o for o in offloaders_of(model)}
    for chain in chains_of(model):
        chain.remove()
    for module in model.modules():
        wrapper = instance_forward(module)
        if isinstance(wrapper, CheckpointedForward):
            set_forward(module, wrapper.previous)
    for offloader in offloaders.values():  # the installation's host memory goes with it
        offloader.free()
    for module in regrouped(model):  # after the unwrapping: a regrouped module's wrapper runs its traced forward
        if id(module) not in keep_groups:
            ungroup(module)
    return removed


def check_plan(model: nn.Module, plan: WrapPlan) -> None:
    """Raise if ``plan`` cannot be put on ``model`` (``user_module(model)``): a name that is no module,
    segments over layers that cannot be a chain where they sit (``chain_check.check_chain``: other
    parents than a Sequential/ModuleList, gaps, a chain running on into an unrelated list) or fewer
    layers than segments. Touches nothing and runs nothing: what the layers get when called is checked
    on a sample input by ``apply/plan.py``, and on every call by the chain."""
    modules = dict(model.named_modules())
    missing = [n for n in plan.names if n not in modules]
    if missing:
        raise ValueError(f"the plan names {', '.join(map(repr, missing))}, not modules of {type(model).__name__}")
    for group in plan.groups:
        if isinstance(group, Segments):
            raise_problems(check_chain(model, list(group.names)), "ckpt.segments")
            schedule(len(group.names), group.segments)  # raises if segments > len(names)


def install(model: nn.Module, plan: WrapPlan) -> list[str]:
    """Put ``plan`` on ``model``, replacing whatever this plugin had put there; returns the names wrapped, in
    the model's registration order (:func:`in_model_order`), whatever order the plan lists them in.

    Everything is checked against the model before the model is touched: an
    error leaves it exactly as it was (wrapped or not). An empty plan unwraps.
    ``model`` may be ``torch.compile(model)``: its modules are wrapped, under their own names.
    """
    model = user_module(model)
    modules = dict(model.named_modules())
    missing = [n for n in plan.regroup if n not in modules]
    if missing:
        raise ValueError(f"the plan regroups {', '.join(map(repr, missing))}, not modules of {type(model).__name__}")
    grouped = [modules[n] for n in plan.regroup if not is_regrouped(modules[n])]
    try:
        for name in plan.regroup:
            if not regroup(modules[name]):
                raise ValueError(f"the plan regroups {name!r}, whose forward has no op groups (op_groups.py)")
        check_plan(model, plan)
    except Exception:
        for module in grouped:  # an error leaves the model as it was
            ungroup(module)
        raise
    kept = {id(modules[n]) for n in plan.regroup}
    _take_off(model, keep_groups=kept)
    modules = dict(model.named_modules())
    side_effects = SideEffects()  # this installation's: it warns about a KV cache once
    # This installation's host pool and copy streams, shared by every layer it offloads: one order of calls per
    # step, so that backward brings the next layers' bytes back ahead of use (offload_copies.py).
    offloader = Offloader() if any(g.treatment.offload for g in plan.groups) else None
    compiled: dict[tuple[str, int], CompiledCalls] = {}  # one per backend and treatment (ckpt=auto: many groups)
    counts = collections.Counter((g.compile, id(g.treatment)) for g in plan.groups if not isinstance(g, Segments)
                                 for _ in g.names)  # layers per compiled calls: their recompile limit
    for group in plan.groups:
        if isinstance(group, Segments):
            layers = [modules[n] for n in group.names]
            ChainCheckpoint(list(group.names), layers, group.segments, group.treatment, side_effects, offloader)
        else:
            calls = None
            if group.compile is not None:
                key = (group.compile, id(group.treatment))
                if key not in compiled:
                    compiled[key] = CompiledCalls(group.compile, group.treatment, counts[key])
                calls = compiled[key]
            for name in group.names:
                wrapper = CheckpointedForward(modules[name], group.treatment, name, side_effects, calls,
                                              offloader if group.treatment.offload else None)
                set_forward(modules[name], wrapper)
    if any(g.treatment.checkpointing for g in plan.groups):
        turn_cache_off_above(model, plan.names, side_effects)  # a Hugging Face model above: use_cache=False
    return in_model_order(model, plan.names)


def in_model_order(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` in ``model.named_modules()`` order (registration), each once: the one order every list of
    wrapped names comes in (issue #33). A plan lists its layers as they run (``ckpt=auto``, chains), and a
    UNet registers ``mid_block`` after ``up_blocks`` but runs it between; only the returned names are sorted."""
    wanted = set(names)
    return [n for n, _ in model.named_modules(remove_duplicate=False) if n in wanted]


@contextlib.contextmanager
def checkpointing_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as if it were not wrapped, then put the very same wrappers back."""
    wrapped = [(m, w.previous) for m in model.modules() if isinstance(w := instance_forward(m), CheckpointedForward)]
    with TemporaryForwards(wrapped), contextlib.ExitStack() as stack:
        for chain in chains_of(model):
            stack.enter_context(chain.paused())
        yield


def compiled_modules(model: nn.Module) -> list[str]:
    """Qualified names of the wrapped modules of ``model`` whose calls run compiled (``ckpt.compile``)."""
    model = user_module(model)
    return [n for n, m in model.named_modules()
            if isinstance(w := instance_forward(m), CheckpointedForward) and w.compiled is not None]


@contextlib.contextmanager
def compiling_paused(model: nn.Module) -> Iterator[None]:
    """Run the wrapped modules of ``model`` eagerly (checkpointed, not compiled), then compiled again.

    For measuring on fake tensors (``measure/report.py``): a compile there would trace
    fake tensors, a graph real tensors can never use, and count against the recompile limit.
    """
    wrappers = [w for m in model.modules()
                if isinstance(w := instance_forward(m), CheckpointedForward) and w.compiled is not None]
    calls = [w.compiled for w in wrappers]
    for w in wrappers:
        w.compiled = None
    try:
        yield
    finally:
        for w, c in zip(wrappers, calls, strict=True):
            w.compiled = c

"""How a wrapped call runs: checkpointed or not, with which selective policy, offloaded or not.

Eager and compiled calls get different ``context_fn``s. Eager: our own
selective modes (``selective/policies.py``), the BatchNorm fix (``norms.py``) and, when
asked for, the named recomputation check (``recompute_check.py``); a call that
needs none of them gets no ``context_fn`` at all, exactly what a hand-written
``checkpoint(fn, x, use_reentrant=False)`` runs. Under ``torch.compile``, dynamo
turns ``checkpoint`` into a higher-order op, AOTAutograd calls ``context_fn``
while tracing and accepts only torch's own selective-checkpoint modes (it
asserts "must generate a tuple of two TorchDispatchModes"): recomputation is
then the partitioner's business, one graph, decided once, so there is no
second run to check and no buffer written twice; the policy alone matters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt_plugin.engine.norms import keep_running_stats
from ckpt_plugin.engine.offload import NothingToMoveNotice, offloading
from ckpt_plugin.engine.offload_copies import Offloader
from ckpt_plugin._compat import tracing_for_compile
from ckpt_plugin.engine.recompute_check import CallRecord, recomputation_checked


@dataclass(frozen=True)
class Treatment:
    """How a wrapped call runs: checkpointed or not, with which policy, offloaded or not."""

    checkpointing: bool = True
    preserve_rng_state: bool = True
    policy: Any = None  # a policies.SelectivePolicy, shared by every module it wraps
    offload: bool = False
    # Another checkpoint implementation instead of torch's: ``checkpoint_fn(forward, running_stats, *args,
    # **kwargs)`` (engine/deepspeed.py's ``checkpointed_call`` for ckpt.deepspeed). None: torch's.
    checkpoint_fn: Callable[..., Any] | None = None
    # Check every call's recomputation by name (ckpt.check_recompute), not only inside
    # recompute_check.checking_recomputation(): a Python hook per saved tensor.
    check_recompute: bool = False
    # Said once for every call this treatment offloads, all layers and steps (offload.NothingToMoveNotice).
    notice: NothingToMoveNotice = field(default_factory=NothingToMoveNotice, compare=False, repr=False)

    def checked(self) -> bool:
        """Whether a call starting now checks its recomputation, naming the module (read per call)."""
        return self.check_recompute or recomputation_checked()

    def offloading(self, offloader: Offloader | None, per_tensor: bool = False) -> contextlib.AbstractContextManager:
        """The context one call runs in: offloading through ``offloader`` (its installation's, shared by all its
        offloaded layers: one host pool, the step's calls in order) where this treatment offloads; each call one
        in the offloader's order, or each storage it copies where ``per_tensor`` (a chain's one context)."""
        if not self.offload:
            return contextlib.nullcontext()
        return offloading(notice=self.notice, offloader=offloader, per_tensor=per_tensor)

    def context_fn(self, stats: list, label: str | None = None, name: str | None = None,
                   ) -> Callable[[], tuple] | None:
        """``checkpoint``'s context_fn, or None when plain ``checkpoint`` would do the same.

        Eager: the policy's contexts, the BatchNorm fix and, when ``label`` names
        the module (``"blocks.1 (TransformerBlock)"``), the check that its
        recomputation saves what its forward saved; while torch.compile traces, torch's modes.
        ``name``: the module's qualified name, which the policy's errors give.

        The choice is made when checkpoint calls it, not when dynamo traces the wrapped
        forward: a graph break inside the module makes dynamo run that checkpoint call
        eagerly, and it must then get the eager contexts.
        """
        if self.policy is None and not stats and label is None:
            return None
        return _Contexts(_contexts, self.policy, _Eager(stats, label, name))


class _Eager:
    """What only the eager contexts need: the BatchNorm statistics to keep, the label of the check, the module's name
    (for errors).

    An object, not a list: dynamo takes a partial's arguments as constants, and a list of
    tensors is none (it broke the graph at the checkpoint, which then ran eagerly)."""

    def __init__(self, stats: list, label: str | None, name: str | None = None) -> None:
        self.stats, self.label, self.name = stats, label, name


def _contexts(policy: Any, eager: _Eager) -> tuple[Any, Any]:
    """The contexts of one checkpointed call: torch's modes while torch.compile traces, else ours."""
    if tracing_for_compile():
        return _compiled_contexts(policy)
    stats, label = eager.stats, eager.label
    forward, recompute = policy.context_fn(eager.name) if policy else (contextlib.nullcontext(),) * 2
    fwd, rec = [lambda: forward], [lambda: recompute, lambda: keep_running_stats(stats)]
    if label is not None:
        record = CallRecord(label, stats)  # one per call: a module may run several times per step
        fwd.append(record.forward)
        rec.append(record.recompute)
    return _Fresh(fwd), _Fresh(rec)


class _Contexts(functools.partial):
    """``checkpoint``'s context_fn for one wrapped call: ``_contexts`` with its arguments bound.

    Not a closure: inductor's FX graph cache pickles the traced graph, the checkpoint's
    context_fn in it, to key the compiled code, and a local function cannot be pickled
    ("Failed to pickle cache key ... Can't pickle local object": every new process
    compiled the graph again). A ``functools.partial``, since dynamo traces a checkpoint's
    context_fn only if it is a function or a partial. What a compiled graph depends on is
    the policy alone (compiled, torch's modes replace the eager contexts), so that is what
    it pickles as (:meth:`__reduce__`) and what ``cache_hash`` says, which AOTAutograd's
    cache requires of a context_fn.
    """

    def __new__(cls, func: Any, policy: Any, eager: _Eager) -> _Contexts:
        self = super().__new__(cls, func, policy, eager)
        self.cache_hash = f"ckpt_plugin {policy!r}"  # the policy's repr names its ops or names
        return self

    def __reduce__(self) -> tuple[Any, tuple]:
        return CompiledKey, (self.cache_hash,)

    def __deepcopy__(self, memo: dict) -> _Contexts:
        # copy.deepcopy(model) (an EMA, Lightning's StochasticWeightAveraging) would otherwise go through
        # __reduce__ and leave the copy a CompiledKey: its BatchNorm statistics are the copy's (memo).
        return _Contexts(self.func, *copy.deepcopy(self.args, memo))

    def __copy__(self) -> _Contexts:
        return _Contexts(self.func, *self.args)


@dataclass(frozen=True)
class CompiledKey:
    """What a compiled graph's cache key holds of a :class:`_Contexts`: the policy's description.

    A pickled model unpickles its checkpointed calls' contexts as this (what they hold is
    the model's own modules, which a cache key must not): calling it says what to do."""

    cache_hash: str

    def __call__(self) -> Any:
        raise RuntimeError(
            "this checkpointed module was unpickled (torch.save of the whole model, then torch.load): the "
            "plugin's contexts do not survive pickling. Call ckpt_plugin.remove_checkpointing(model) and "
            "apply checkpointing again after loading (or save and load its state_dict, as Lightning does)")


def _compiled_contexts(policy: Any) -> tuple[Any, Any]:
    """torch's selective-checkpoint modes, deciding with ``policy`` (None: recompute every op,
    exactly what torch.compile does for a checkpoint without context_fn)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    if policy is None:
        return create_selective_checkpoint_contexts(lambda *_, **__: CheckpointPolicy.PREFER_RECOMPUTE)
    if policy.uses_names:
        raise ValueError(NAMES_UNDER_COMPILE)
    return create_selective_checkpoint_contexts(policy)


NAMES_UNDER_COMPILE = (
    "ckpt.policy=names does not work under torch.compile: checkpoint_name tags are emitted only inside "
    "the plugin's own eager selective modes, which torch.compile replaces by torch's, so no tag would "
    "be saved. Use ckpt.policy=matmuls or a list of aten ops (these work compiled), or run uncompiled."
)


class _Fresh:
    """Enters context managers made afresh on every entry.

    checkpoint enters a call's recompute context once per recomputation, and a
    region is recomputed again by a second backward (``retain_graph=True``) and
    by a double backward (``create_graph=True``): a generator-based context
    manager cannot be entered twice.
    """

    def __init__(self, factories: list[Callable[[], contextlib.AbstractContextManager]]) -> None:
        self.factories = factories
        self.stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for make in self.factories:
                stack.enter_context(make())
            self.stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> bool:
        return self.stacks.pop().__exit__(*exc)

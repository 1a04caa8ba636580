"""How a wrapped call runs: checkpointed or not, with which selective policy, offloaded or not.

Eager and compiled calls get different ``context_fn``s. Eager: our own
selective modes (``policies.py``), the BatchNorm fix (``norms.py``) and, when
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt_plugin.engine.norms import keep_running_stats
from ckpt_plugin.engine.offload import offloading
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

    def checked(self) -> bool:
        """Whether a call starting now checks its recomputation, naming the module (read per call)."""
        return self.check_recompute or recomputation_checked()

    def offloading(self) -> contextlib.AbstractContextManager:
        if not self.offload:
            return contextlib.nullcontext()
        return offloading()

    def context_fn(self, stats: list, label: str | None = None) -> Callable[[], tuple] | None:
        """``checkpoint``'s context_fn, or None when plain ``checkpoint`` would do the same.

        Eager: the policy's contexts, the BatchNorm fix and, when ``label`` names
        the module (``"blocks.1 (TransformerBlock)"``), the check that its
        recomputation saves what its forward saved; while torch.compile traces, torch's modes.

        The choice is made when checkpoint calls it, not when dynamo traces the wrapped
        forward: a graph break inside the module makes dynamo run that checkpoint call
        eagerly, and it must then get the eager contexts.
        """
        if self.policy is None and not stats and label is None:
            return None
        policy = self.policy

        def contexts() -> tuple[Any, Any]:
            if tracing_for_compile():
                return _compiled_contexts(policy)
            forward, recompute = policy.context_fn() if policy else (contextlib.nullcontext(),) * 2
            fwd, rec = [lambda: forward], [lambda: recompute, lambda: keep_running_stats(stats)]
            if label is not None:
                record = CallRecord(label, stats)  # one per call: a module may run several times per step
                fwd.append(record.forward)
                rec.append(record.recompute)
            return _Fresh(fwd), _Fresh(rec)

        # AOTAutograd caches a compiled graph with a context_fn only if the context_fn says
        # what it does; compiled, only the policy matters (its repr names its ops or names).
        contexts.cache_hash = f"ckpt_plugin {policy!r}"  # type: ignore[attr-defined]
        return contexts


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

"""Selective checkpointing: save the outputs of chosen ops, recompute the rest.

JAX's checkpoint policies, for PyTorch's non-reentrant checkpoint::

    policy = make_policy("matmuls")                      # jax dots_saveable
    policy = make_policy("matmuls_no_batch")             # dots_with_no_batch_dims_saveable
    policy = make_policy("names", save_names=["attn"])   # save_only_these_names
    policy = make_policy("names", exclude_names=["h"])   # save_any_names_but_these
    policy = make_policy(["aten.mm", "addmm"])           # an explicit op list
    out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=policy.context_fn)

    python recipes/train.py ckpt=selective ckpt.layers=TransformerBlock ckpt.policy=matmuls

The decision is torch's (``SelectivePolicy`` is a ``create_selective_checkpoint_contexts``
policy function), but ``context_fn`` returns our own pair of dispatch modes
(``selective_modes.py``) rather than torch's, for one reason: torch keeps the saved outputs in a private
dict that ``saved_tensors_hooks`` never see, so they escape both our
measurements (``measure.saved_bytes``) and CPU offloading. Ours hand every
saved output to the hooks that were active around the checkpoint call, exactly
as autograd hands it the tensors it saves. (Under ``torch.compile``, which wants
torch's own modes, pass ``lambda: create_selective_checkpoint_contexts(policy)``;
``checkpoint_name`` tags (``name_tags.py``) are then not emitted.)

Random ops are always recomputed: a saved op is not run again, so if it drew
random numbers the recomputation's RNG stream (replayed from the forward's
state by ``preserve_rng_state``) would fall out of step with the forward for
every later random op. Naming a random op in an op list is an error;
attention counts as random only in calls with ``dropout_p > 0``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_plugin._compat import TorchDispatchMode
from ckpt_plugin._compat import argument as _argument
from ckpt_plugin.config.policy import PolicySpec, read_policy
from ckpt_plugin.engine.selective.name_tags import NAME_OP, checkpoint_name
from ckpt_plugin.engine.selective.selective_modes import SavedOutputModified, region_modes
from ckpt_plugin.errors import Problem, closest_first, raise_problems


_ABSENT = object()


def _draws_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call consumes random numbers (attention does only with dropout)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    return _argument(op, args, kwargs, "dropout_p", _ABSENT) not in (0, 0.0)


class SelectivePolicy:
    """Which op outputs a checkpointed region saves; everything else is recomputed.

    Build it with :func:`make_policy`. It is a ``torch.utils.checkpoint`` policy
    function (``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``) and gives
    the ``context_fn`` for ``checkpoint(..., use_reentrant=False, context_fn=...)``.
    ``seen_names`` collects the ``checkpoint_name`` tags met by forwards so far;
    ``uses_names`` is whether it goes by those tags (``policy="names"``) rather than by ops.
    :meth:`check_names_when_recomputing` (``apply_checkpointing`` asks it) runs :meth:`check_names`
    once, as the first recomputation starts: by then the whole forward of the step has tagged.
    One policy serves the layers of one installation (``treatment_of`` reads one per plan), so
    its names and that check are the installation's, never another model's.
    """

    def __init__(self, policy: Any, *, save_names: Any = None, exclude_names: Any = None) -> None:
        self._take(read_policy(policy, save_names=save_names, exclude_names=exclude_names))

    @classmethod
    def of(cls, spec: PolicySpec) -> SelectivePolicy:
        """The policy a config read already (``SelectiveConfig.read_policy``): nothing is read again."""
        policy = cls.__new__(cls)
        policy._take(spec)
        return policy

    def _take(self, spec: PolicySpec) -> None:
        self.policy, self.ops, self.uses_names = spec.policy, spec.ops, spec.uses_names
        self.save_names, self.exclude_names = spec.save_names, spec.exclude_names
        self.seen_names: set[str] = set()
        self._names_pending = False  # check_names at the next recomputation (check_names_when_recomputing)

    def saves(self, op: Any, args: tuple, kwargs: dict, *, record: bool = True) -> bool:
        """Whether the output of this call of ``op`` is kept for backward."""
        if op is NAME_OP:
            if not self.uses_names:  # a names region nested in this one tags for itself
                return False
            name = args[1]
            if record:
                self.seen_names.add(name)
            return name in self.save_names if self.save_names is not None else name not in self.exclude_names
        # A saved random op would not be replayed (config/policy.py refuses naming one): recompute that call.
        return op in self.ops and not _draws_random(op, args, kwargs)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = self.saves(op, args, kwargs, record=not getattr(ctx, "is_recompute", False))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self, module: str | None = None) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """(forward, recompute) contexts for one checkpointed call; give it to ``checkpoint``.
        ``module``: the name of the module checkpointed, for errors."""
        return region_modes(self, module)

    def check_names_when_recomputing(self) -> None:
        """Check the names (:meth:`check_names`) as the next recomputation starts, once."""
        self._names_pending = True

    def before_recompute(self) -> None:
        """What a region's recomputation asks first: the names check, where one is pending."""
        if self._names_pending:
            self._names_pending = False
            self.check_names()

    def check_names(self) -> None:
        """Raise if a name in save_names/exclude_names was never met by a forward."""
        used = ", ".join(sorted(self.seen_names)) or "(none)"
        problems: list[Problem] = []
        for key, names in (("save_names", self.save_names), ("exclude_names", self.exclude_names)):
            for name in names or ():
                if name not in self.seen_names:
                    near = ", ".join(closest_first(name, self.seen_names)) or "(none)"
                    problems.append(Problem(f"ckpt.{key}", f"ckpt.{key}: no checkpoint_name in the model uses "
                                            f"{name!r}", f"names used: {near}"))
        raise_problems(problems, f"the names of the policy (names used: {used})")

    def __repr__(self) -> str:
        keys = (("save_names", self.save_names), ("exclude_names", self.exclude_names))
        names = "".join(f", {k}={v!r}" for k, v in keys if v)
        return f"SelectivePolicy({self.policy!r}{names})"


def make_policy(policy: Any, *, save_names: Any = None, exclude_names: Any = None) -> SelectivePolicy:
    """Build and validate a :class:`SelectivePolicy` from the ``ckpt`` keys ``policy``,
    ``save_names`` and ``exclude_names``; errors name those keys."""
    return SelectivePolicy(policy, save_names=save_names, exclude_names=exclude_names)


__all__ = ["SavedOutputModified", "SelectivePolicy", "checkpoint_name", "make_policy"]

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

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_plugin.errors import Problem, closest_first, raise_problems

from ckpt_plugin._compat import TorchDispatchMode, argument as _argument, is_mutable as _is_mutable
from ckpt_plugin.engine.name_tags import NAME_OP, checkpoint_name
from ckpt_plugin.engine.selective_modes import SavedOutputModified, region_modes


_Packet = type(torch.ops.aten.mm)
_ABSENT = object()

# Every matmul-like op (JAX dots_saveable saves dot_general and conv_general_dilated).
# Composite ops (linear, matmul, conv2d, scaled_dot_product_attention) usually decompose
# before dispatch and are listed for the tracers that keep them whole.
MATMULS_NO_BATCH = (
    "mm", "addmm", "_addmm_activation", "mv", "addmv", "dot", "vdot", "linear", "_int_mm", "_scaled_mm",
)
MATMULS = MATMULS_NO_BATCH + (
    "bmm", "baddbmm", "matmul", "_grouped_mm", "_scaled_grouped_mm",
    "convolution", "_convolution", "convolution_overrideable", "cudnn_convolution",
    "cudnn_convolution_transpose", "mkldnn_convolution", "_slow_conv2d_forward",
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward",
)
# What ``matmuls`` saves and ``matmuls_no_batch`` does not, convolutions aside: the batched matmuls (attention).
BATCHED_MATMULS = frozenset(op for op in MATMULS if op not in MATMULS_NO_BATCH and "conv" not in op)
POLICIES = ("matmuls", "matmuls_no_batch", "names")
_OPS_OF = {"matmuls": MATMULS, "matmuls_no_batch": MATMULS_NO_BATCH}  # the policies that are op lists


# ---------------------------------------------------------------------- op names

def _aten_op_names() -> list[str]:
    aten = torch.ops.aten
    return [n for n in dir(aten) if not n.startswith("__") and isinstance(getattr(aten, n, None), _Packet)]


def _refusal(op: Any) -> str | None:
    """Why saving ``op``'s output could not be honoured, or None when it can."""
    if _is_mutable(op):
        return "writes into its input (in-place or out=); only functional ops can be saved"
    if op.is_view:
        return "returns a view of its input; saving it keeps nothing of its own"
    if torch.Tag.nondeterministic_seeded in op.tags and _argument(op, (), {}, "dropout_p", _ABSENT) is _ABSENT:
        return ("draws random numbers: a saved random op is not replayed by the recomputation, which "
                "would shift the random numbers of every later op; random ops are always recomputed")
    return None


def resolve_op(text: str) -> tuple[list[Any], Problem | None]:
    """``"aten.mm"``, ``"mm"``, ``"aten::mm.default"``, ``"torch.ops.aten.mm"`` -> overloads.

    A packet gives its functional overloads. Returns ``(overloads, problem)``,
    the problem (about ``ckpt.policy``) None when the op resolves.
    """
    spec = text.strip().removeprefix("torch.ops.").replace("::", ".").removeprefix("aten.")
    name, _, overload = spec.partition(".")
    packet = getattr(torch.ops.aten, name, None) if name and "." not in overload else None
    if not isinstance(packet, _Packet):
        near = ", ".join(closest_first(name or spec, _aten_op_names())[:6])
        return [], Problem("ckpt.policy", f"ckpt.policy: unknown op {text!r}", f"closest aten ops: {near}")
    if overload:
        if overload not in packet.overloads():
            return [], Problem("ckpt.policy", f"ckpt.policy: aten.{name} has no overload {overload!r}",
                               f"its overloads: {', '.join(closest_first(overload, packet.overloads()))}")
        op = getattr(packet, overload)
        why = _refusal(op)
        return ([], _refused(text, why)) if why else ([op], None)
    ops = [getattr(packet, o) for o in packet.overloads()]
    usable = [op for op in ops if _refusal(op) is None]
    if not usable:
        return [], _refused(text, _refusal(ops[0]))
    return usable, None


def _refused(text: str, why: str) -> Problem:
    return Problem("ckpt.policy", f"ckpt.policy: {text!r} {why}")


def _builtin_ops(names: Iterable[str]) -> frozenset:
    # Ops missing from this torch build (or this platform) are simply absent.
    return frozenset(op for n in names if hasattr(torch.ops.aten, n) for op in resolve_op(n)[0])


def _draws_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call consumes random numbers (attention does only with dropout)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    return _argument(op, args, kwargs, "dropout_p", _ABSENT) not in (0, 0.0)


# ---------------------------------------------------------------------- the policy

def _names(key: str, value: Any) -> tuple[tuple[str, ...] | None, list[Problem]]:
    if value is None:
        return None, []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable) or isinstance(value, (bytes, dict)):
        return None, [Problem(f"ckpt.{key}",
                              f"ckpt.{key}={value!r} ({type(value).__name__}) must be a name or a list of names")]
    value = list(value)
    bad = [v for v in value if not isinstance(v, str) or not v.strip()]
    if bad or not value:
        return None, [Problem(f"ckpt.{key}",
                              f"ckpt.{key}={value!r}: give one or more non-empty names used with checkpoint_name")]
    return tuple(dict.fromkeys(v.strip() for v in value)), []


class SelectivePolicy:
    """Which op outputs a checkpointed region saves; everything else is recomputed.

    Build it with :func:`make_policy`. It is a ``torch.utils.checkpoint`` policy
    function (``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``) and gives
    the ``context_fn`` for ``checkpoint(..., use_reentrant=False, context_fn=...)``.
    ``seen_names`` collects the ``checkpoint_name`` tags met by forwards so far;
    ``uses_names`` is whether it goes by those tags (``policy="names"``) rather than by ops.
    ``check_in_backward`` (set by ``apply_checkpointing``) runs :meth:`check_names` once, as
    the first recomputation starts: by then the whole forward of the step has tagged.
    """

    def __init__(self, policy: Any, *, save_names: Any = None, exclude_names: Any = None) -> None:
        save, problems = _names("save_names", save_names)
        exclude, more = _names("exclude_names", exclude_names)
        problems += more
        self.save_names, self.exclude_names = save, exclude
        self.ops: frozenset = frozenset()
        keys = (("save_names", save_names), ("exclude_names", exclude_names))
        given = [f"ckpt.{k}" for k, v in keys if v is not None]
        self.uses_names: bool = isinstance(policy, str) and policy == "names"
        if self.uses_names:
            if save_names is not None and exclude_names is not None:
                problems.append(Problem(
                    "ckpt.save_names",
                    "ckpt.save_names and ckpt.exclude_names are both set: give one, "
                    "save_names to save only those names, exclude_names to save every name but those"))
            elif save_names is None and exclude_names is None:
                problems.append(Problem(
                    "ckpt.save_names",
                    "ckpt.policy=names needs ckpt.save_names (save only these names) or "
                    "ckpt.exclude_names (save every name but these)"))
        elif isinstance(policy, str):
            if policy in _OPS_OF:
                self.ops = _builtin_ops(_OPS_OF[policy])
            else:
                problems.append(Problem(
                    "ckpt.policy", f"ckpt.policy={policy!r} is not a policy",
                    f"valid policies, closest first: {', '.join(closest_first(policy, POLICIES))}, "
                    "or a list of aten op names"))
        elif isinstance(policy, Iterable) and not isinstance(policy, (bytes, dict)):
            policy = tuple(policy)
            if not policy:
                problems.append(Problem("ckpt.policy", "ckpt.policy=[] names no ops: give aten op names such as "
                                        f"[mm, addmm], or one of {', '.join(POLICIES)}"))
            ops = set()
            for text in policy:
                if not isinstance(text, str):
                    problems.append(Problem("ckpt.policy", f"ckpt.policy: op names must be strings, got {text!r}"))
                    continue
                if text in POLICIES:
                    problems.append(Problem("ckpt.policy", f"ckpt.policy: {text!r} is a policy, not an op: "
                                            f"write ckpt.policy={text}"))
                    continue
                found, problem = resolve_op(text)
                ops.update(found)
                problems += [problem] if problem else []
            self.ops = frozenset(ops)
        elif policy is not None or not given:  # None with names: the names' problem below says it
            problems.append(Problem("ckpt.policy", f"ckpt.policy={policy!r} ({type(policy).__name__}) must be one "
                                    f"of {', '.join(POLICIES)} or a list of aten op names"))
        if given and not self.uses_names:
            verb = "needs" if len(given) == 1 else "need"
            problems.append(Problem("ckpt.policy",
                                    f"{' and '.join(given)} {verb} ckpt.policy=names, got ckpt.policy={policy!r}"))
        raise_problems(problems, "the selective checkpointing policy")
        self.policy = policy
        self.seen_names: set[str] = set()
        self.check_in_backward: bool = False

    def saves(self, op: Any, args: tuple, kwargs: dict, *, record: bool = True) -> bool:
        """Whether the output of this call of ``op`` is kept for backward."""
        if op is NAME_OP:
            if not self.uses_names:  # a names region nested in this one tags for itself
                return False
            name = args[1]
            if record:
                self.seen_names.add(name)
            return name in self.save_names if self.save_names is not None else name not in self.exclude_names
        # A saved random op would not be replayed (see _refusal): recompute that call.
        return op in self.ops and not _draws_random(op, args, kwargs)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = self.saves(op, args, kwargs, record=not getattr(ctx, "is_recompute", False))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self, module: str | None = None) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """(forward, recompute) contexts for one checkpointed call; give it to ``checkpoint``.
        ``module``: the name of the module checkpointed, for errors."""
        return region_modes(self, module)

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


__all__ = [
    "BATCHED_MATMULS",
    "MATMULS",
    "MATMULS_NO_BATCH",
    "POLICIES",
    "SavedOutputModified",
    "SelectivePolicy",
    "checkpoint_name",
    "make_policy",
    "resolve_op",
]

"""``ckpt.policy`` (with ``save_names``/``exclude_names``), read once: which ops' outputs a selective region saves,
or which ``checkpoint_name`` tags. The engine's :class:`~ckpt_plugin.engine.selective.policies.SelectivePolicy` applies what
this reads; the schema checks a ``ckpt=selective`` config with it. Op names resolve against ``torch.ops.aten``, so
this module loads torch (the schema imports it only when it checks a selective config).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_plugin._compat import argument as _argument
from ckpt_plugin._compat import is_mutable as _is_mutable
from ckpt_plugin.errors import Problem, closest_first, raise_problems

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

@dataclass(frozen=True)
class PolicySpec:
    """What a selective region saves: the outputs of ``ops``, or (``uses_names``) the ``checkpoint_name`` tags named
    by ``save_names``, or every tag but ``exclude_names``. ``policy`` is the value as given, for messages."""

    policy: Any
    ops: frozenset
    uses_names: bool
    save_names: tuple[str, ...] | None
    exclude_names: tuple[str, ...] | None


def read_policy(policy: Any, *, save_names: Any = None, exclude_names: Any = None) -> PolicySpec:
    """``ckpt.policy``, ``save_names`` and ``exclude_names``, read and checked together; errors name those keys."""
    save, problems = _names("save_names", save_names)
    exclude, more = _names("exclude_names", exclude_names)
    problems += more
    ops: frozenset = frozenset()
    keys = (("save_names", save_names), ("exclude_names", exclude_names))
    given = [f"ckpt.{k}" for k, v in keys if v is not None]
    uses_names = isinstance(policy, str) and policy == "names"
    if uses_names:
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
            ops = _builtin_ops(_OPS_OF[policy])
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
        found_ops = set()
        for text in policy:
            if not isinstance(text, str):
                problems.append(Problem("ckpt.policy", f"ckpt.policy: op names must be strings, got {text!r}"))
                continue
            if text in POLICIES:
                problems.append(Problem("ckpt.policy", f"ckpt.policy: {text!r} is a policy, not an op: "
                                        f"write ckpt.policy={text}"))
                continue
            found, problem = resolve_op(text)
            found_ops.update(found)
            problems += [problem] if problem else []
        ops = frozenset(found_ops)
    elif policy is not None or not given:  # None with names: the names' problem below says it
        problems.append(Problem("ckpt.policy", f"ckpt.policy={policy!r} ({type(policy).__name__}) must be one "
                                f"of {', '.join(POLICIES)} or a list of aten op names"))
    if given and not uses_names:
        verb = "needs" if len(given) == 1 else "need"
        problems.append(Problem("ckpt.policy",
                                f"{' and '.join(given)} {verb} ckpt.policy=names, got ckpt.policy={policy!r}"))
    raise_problems(problems, "the selective checkpointing policy")
    return PolicySpec(policy, ops, uses_names, save, exclude)


__all__ = ["BATCHED_MATMULS", "MATMULS", "MATMULS_NO_BATCH", "POLICIES", "PolicySpec", "read_policy", "resolve_op"]

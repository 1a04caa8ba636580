"""The values of ``ckpt`` keys that are judged on their own, before any model: a segments value and a
torch.compile backend's name. The engine reads them the same way (``engine/sequential.py``,
``engine/regional.py``), so they are written here, below it, once."""

from __future__ import annotations

from typing import Any

from ckpt_plugin.errors import Problem, closest_first

SEGMENT_WORDS = ("sqrt", "recursive", "optimal")
DEFAULT_BACKEND = "inductor"  # what ckpt.compile=true means: torch.compile's own default


def segment_problems(segments: Any, key: str = "ckpt.segments") -> list[Problem]:
    """What is wrong with a ``segments`` value on its own (not knowing the chain's length)."""
    if segments is None or segments in SEGMENT_WORDS:
        return []
    if isinstance(segments, bool) or not isinstance(segments, int):
        return [Problem(
            key,
            f"{key}={segments!r} ({type(segments).__name__}) must be an integer >= 1, "
            f"'sqrt', 'recursive' or 'optimal' (or null for one checkpoint per layer)",
        )]
    if segments < 1:
        return [Problem(
            key, f"{key}={segments} must be >= 1: the number of checkpointed segments (or 'sqrt', 'recursive')"
        )]
    return []


def backends() -> list[str]:
    """Every backend ``torch.compile(backend=...)`` accepts by name, debug ones (``aot_eager``) included."""
    import torch  # only when a backend's name is judged: the schema loads no framework at import

    return torch.compiler.list_backends(exclude_tags=())


def backend_of(value: bool | str) -> str | None:
    """The backend a validated ``ckpt.compile`` value asks for: true is inductor, false is None."""
    if value is True:
        return DEFAULT_BACKEND
    return value or None


def compile_problems(config: Any) -> list[Problem]:
    """``ckpt.compile``: true (inductor), false or a backend name, and not with what has no one call to compile."""
    value = config.compile
    if isinstance(value, str):
        names = backends()
        if value not in names:
            near = ", ".join(repr(b) for b in closest_first(value, names)[:5])
            return [Problem(
                "ckpt.compile", f"ckpt.compile={value!r} is not a torch.compile backend",
                f"give true (inductor), false or a backend name; closest first: {near}, ... "
                "(torch.compiler.list_backends(exclude_tags=()) lists them all)",
            )]
    elif not isinstance(value, bool):
        return [Problem(
            "ckpt.compile",
            f"ckpt.compile={value!r} ({type(value).__name__}) must be true (inductor), false or the name of a "
            "torch.compile backend",
        )]
    if value is False:
        return []
    on = f"ckpt.compile={str(value).lower() if value is True else value}"
    problems = []
    segments = getattr(config, "segments", None)
    if segments is not None:
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.segments={segments}: a segment is one checkpoint over several "
            "layers' calls, opened in the first layer's forward pre-hook and closed in the last one's forward "
            "hook, so there is no one call to compile",
            "drop ckpt.segments (each layer is then its own compiled checkpoint), or drop ckpt.compile",
        ))
    if getattr(config, "deepspeed", None) is not None:
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.deepspeed (DeepSpeed's own checkpoint): torch.compile captures "
            "torch's checkpoint as one region, not DeepSpeed's reentrant autograd Function",
            "drop ckpt.compile, or drop ckpt.deepspeed (ckpt=full: torch's checkpoint, which compiles)",
        ))
    if getattr(config, "check_recompute", False) is True:
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.check_recompute=true: compiled, a layer's recomputation is part "
            "of its compiled backward graph, not a second run of its forward, so there is nothing to check",
            "drop one of the two",
        ))
    if getattr(config, "policy", None) == "names":
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.policy=names: checkpoint_name tags are emitted only in the "
            "plugin's eager selective modes, which torch.compile replaces by torch's, so no tag would be saved",
            "use ckpt.policy=matmuls or a list of aten ops (these compile), or drop ckpt.compile",
        ))
    return problems


TIMINGS = ("auto", "eager", "compiled")
_TIMINGS_SHOWN = ", ".join(repr(t) for t in TIMINGS)


def timing_problems(value: Any) -> list[Problem]:
    """``ckpt.timing``: auto, eager, compiled, or a torch.compile backend's name."""
    if not isinstance(value, str):
        return [Problem("ckpt.timing", f"ckpt.timing={value!r} ({type(value).__name__}) must be one of "
                        f"{_TIMINGS_SHOWN} or the name of a torch.compile backend")]
    if value in TIMINGS:
        return []
    names = backends()
    if value in names:
        return []
    near = ", ".join(repr(b) for b in closest_first(value, [*TIMINGS, *names])[:5])
    return [Problem(
        "ckpt.timing", f"ckpt.timing={value!r} is neither {_TIMINGS_SHOWN} nor a torch.compile backend",
        f"closest first: {near}, ... (torch.compiler.list_backends(exclude_tags=()) lists the backends)",
    )]


__all__ = ["DEFAULT_BACKEND", "SEGMENT_WORDS", "TIMINGS", "backend_of", "backends", "compile_problems", "segment_problems",
           "timing_problems"]

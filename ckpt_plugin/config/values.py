"""The values of ``ckpt`` keys that are judged on their own, before any model: a segments value and a
torch.compile backend's name. The engine reads them the same way (``engine/segments/sequential.py``,
``engine/regional.py``), so they are written here, below it, once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckpt_plugin.errors import Problem, closest_first

SEGMENT_WORDS = ("sqrt", "recursive", "optimal")
MISSING = "???"  # OmegaConf's MISSING value, without importing OmegaConf (the schema loads no framework)
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


def read_layers(value: Any) -> tuple[tuple[str, ...] | None, list[Problem]]:
    """``ckpt.layers`` read: a tuple of stripped entries (None where it cannot be read), and its problems."""
    if value is None or value == MISSING:
        return None, [Problem(
            "ckpt.layers",
            "ckpt.layers is required: name the modules to checkpoint, e.g. "
            "ckpt.layers=TransformerBlock or ckpt.layers=[Block,'blocks.*'], or let "
            "ckpt.layers=auto choose them (or choose ckpt=none to switch checkpointing off)",
        )]
    layers = [value] if isinstance(value, str) else value
    if not isinstance(layers, Iterable) or isinstance(layers, (bytes, dict)):
        return None, [Problem(
            "ckpt.layers",
            f"ckpt.layers={layers!r} ({type(layers).__name__}) must be a string or a list "
            "of strings: class names, dotted class paths, module-name globs or 're:' regexes",
        )]
    layers = list(layers)
    bad = [x for x in layers if not isinstance(x, str) or not x.strip()]
    if bad:
        return None, [Problem(
            "ckpt.layers",
            f"ckpt.layers: every entry must be a non-empty string, got {', '.join(repr(b) for b in bad)}"
            if all(isinstance(b, str) for b in bad)
            else f"ckpt.layers: every entry must be a string, got {bad!r}",
        )]
    if not layers:
        return None, [Problem(
            "ckpt.layers",
            "ckpt.layers=[] names no layers: give at least one class name or pattern, "
            "or choose ckpt=none to switch checkpointing off",
        )]
    read = tuple(x.strip() for x in layers)
    if "auto" in read and len(read) > 1:
        others = ", ".join(repr(x) for x in read if x != "auto")
        return read, [Problem(
            "ckpt.layers",
            "ckpt.layers: 'auto' chooses every layer itself and cannot be combined with "
            f"other entries ({others})",
            "give ckpt.layers=auto alone, or name every layer",
        )]
    return read, []


def every_n_problems(every_n: Any) -> list[Problem]:
    """``ckpt.every_n``: an integer >= 1."""
    if isinstance(every_n, bool) or not isinstance(every_n, int):
        return [Problem(
            "ckpt.every_n",
            f"ckpt.every_n={every_n!r} ({type(every_n).__name__}) must be an integer >= 1",
        )]
    if every_n < 1:
        return [Problem(
            "ckpt.every_n",
            f"ckpt.every_n={every_n} must be >= 1: 1 wraps every matched layer, 2 every second one, ...",
        )]
    return []


__all__ = ["every_n_problems", "read_layers", "DEFAULT_BACKEND", "SEGMENT_WORDS", "TIMINGS", "backend_of", "backends", "compile_problems", "segment_problems",
           "timing_problems"]

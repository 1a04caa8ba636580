"""Which modules of a model ``ckpt.layers`` and ``ckpt.every_n`` select.

Each entry of ``ckpt.layers`` is read by its shape:

================================  ==========================================
``auto``                          chosen from the model; alone, not in a
                                  list (:func:`resolve_layers`)
``head``, ``TransformerBlock``    a plain word: the top-level module of that
                                  name if there is one, else the modules
                                  whose class is named exactly that (the
                                  module name wins: the narrower reading)
``blocks.3``, ``pkg.mod.Block``   the submodule of that qualified name if
                                  there is one, else instances of the
                                  imported class (subclasses included)
``blocks.*``, ``*.attn``          module names matching the glob (``*?[``)
``re:blocks\\.[0-9]+``            module names fully matching the regex
================================  ==========================================

Names are the user's own module's: a ``torch.compile``, DDP, FSDP (v1) or
Lightning Fabric wrapper around the model is looked through
(``_compat.user_module``), so ``blocks.0`` never becomes ``module.blocks.0``.

Selection is checked against the model before anything is wrapped, and every
entry that matches nothing is reported at once, with the names that do exist
(closest first), so a typo never becomes a silent no-op.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ckpt_plugin._compat import user_module
from ckpt_plugin.engine.blocks import find_blocks, has_forward
from ckpt_plugin.errors import Problem, closest_first, raise_problems

_SHOWN = 12  # how many existing names an error lists before "..."


def _shown(names: list[str]) -> str:
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


# ---------------------------------------------------------------------- the kinds of entry

@dataclass(frozen=True)
class ClassName:
    """``TransformerBlock``: modules whose class, or a base of it, has that name."""

    text: str

    def matches(self, name: str, module: nn.Module) -> bool:
        # The class or a base: FSDP2's fully_shard swaps a module's class for a subclass
        # (TransformerBlock -> FSDPTransformerBlock) that must still match its own name.
        return any(c.__name__ == self.text for c in type(module).__mro__)

    def nothing_matched(self, model: nn.Module, names: list[str]) -> Problem:
        # A plain word is a class name only once it is no top-level module's name: offer both.
        classes = {type(m).__name__ for m in model.modules()}
        return Problem(
            "ckpt.layers",
            f"ckpt.layers: no module of class {self.text!r} in {type(model).__name__} and none named {self.text!r}",
            f"class names in this model, closest first: {_shown(closest_first(self.text, classes))}; "
            f"module names, closest first: {_shown(closest_first(self.text, names))}",
        )


@dataclass(frozen=True)
class ClassPath:
    """``pkg.models.Block``: instances of the imported class, subclasses included."""

    text: str
    cls: type

    def matches(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, self.cls)

    def nothing_matched(self, model: nn.Module, names: list[str]) -> Problem:
        return Problem(
            "ckpt.layers",
            f"ckpt.layers: no module in {type(model).__name__} is an instance of {self.text!r}",
            f"class names in this model: {_shown(sorted({type(m).__name__ for m in model.modules()}))}",
        )


class _ByModuleName:
    """An entry matched against module names; ``kind`` names it in errors."""

    text: str
    kind: ClassVar[str]

    def nothing_matched(self, model: nn.Module, names: list[str]) -> Problem:
        return Problem(
            "ckpt.layers",
            f"ckpt.layers: the {self.kind} {self.text!r} matches no module name in {type(model).__name__}",
            f"module names, closest first: {_shown(closest_first(self.text, names))}",
        )


@dataclass(frozen=True)
class ModuleName(_ByModuleName):
    """``blocks.3``, ``head``: the submodule of exactly that qualified name."""

    text: str
    kind: ClassVar[str] = "module name"

    def matches(self, name: str, module: nn.Module) -> bool:
        return name == self.text


@dataclass(frozen=True)
class Glob(_ByModuleName):
    """``blocks.*``: module names matching the glob."""

    text: str
    kind: ClassVar[str] = "glob"

    def matches(self, name: str, module: nn.Module) -> bool:
        return fnmatch.fnmatchcase(name, self.text)


@dataclass(frozen=True)
class Regex(_ByModuleName):
    """``re:blocks\\.[0-9]+``: module names fully matching the regex after ``re:``."""

    text: str
    pattern: re.Pattern
    kind: ClassVar[str] = "regex"

    def matches(self, name: str, module: nn.Module) -> bool:
        return self.pattern.fullmatch(name) is not None


Selector = ClassName | ClassPath | ModuleName | Glob | Regex


def _import_class(path: str) -> type | None:
    """The class at ``path``, or None when it does not import or is not a class."""
    module_path, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return obj if isinstance(obj, type) else None


def _parse(text: str, names: list[str], problems: list[Problem]) -> Selector | None:
    if text.startswith("re:"):
        try:
            pattern = re.compile(text[3:])
        except re.error as err:
            problems.append(Problem("ckpt.layers", f"ckpt.layers: {text!r} is not a valid regular expression ({err})"))
            return None
        return Regex(text, pattern)
    if any(c in text for c in "*?["):
        return Glob(text)
    if text in names:  # "head", "blocks.3": a module's own name is the narrower reading
        return ModuleName(text)
    if "." not in text:
        return ClassName(text)
    cls = _import_class(text)
    if cls is None:
        problems.append(Problem(
            "ckpt.layers",
            f"ckpt.layers: {text!r} is neither a module name in the model nor an importable class "
            f"(write a class as 'package.module.ClassName')",
            f"module names, closest first: {_shown(closest_first(text, names))}",
        ))
        return None
    return ClassPath(text, cls)


# ---------------------------------------------------------------------- ckpt.layers=auto

AUTO = "auto"


def _count(named: list[tuple[str, nn.Module]], classes: Sequence[str]) -> int:
    """How many modules ``ckpt.layers=classes`` selects (nested matches dropped)."""
    chosen = {n for n, m in named if any(ClassName(c).matches(n, m) for c in classes)}
    return sum(not _has_ancestor_in(n, chosen) for n in chosen)


def _modules(n: int) -> str:
    return f"{n} module" if n == 1 else f"{n} modules"


def resolve_layers(model: nn.Module, layers: str | Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """``ckpt.layers`` with ``auto`` replaced by the class names it chooses on ``model``, and a note saying so.

    ``auto`` (alone: it chooses every layer itself) picks the model's blocks by
    the rules of :mod:`ckpt_plugin.engine.blocks`: what the model's library
    checkpoints itself (Hugging Face's ``GradientCheckpointingLayer``, what
    diffusers' and timm's own switches checkpoint), else the repeated blocks
    of its structure, else Hugging Face's ``_no_split_modules``.
    Every module of the chosen classes is then selected, as ``ckpt.layers=<classes>``
    would. The note reads ``ckpt.layers=auto chose GPT2Block (HF
    GradientCheckpointingLayer): 12 modules``; it is None when
    ``layers`` has no ``auto``, which is then returned as it is. Raises a ConfigError
    when nothing repeats, or when ``auto`` is in a list with other entries.
    """
    layers = (layers,) if isinstance(layers, str) else tuple(layers)
    if AUTO not in layers:
        return layers, None
    if len(layers) > 1:
        others = ", ".join(repr(x) for x in layers if x != AUTO)
        raise_problems([Problem(
            "ckpt.layers",
            f"ckpt.layers: 'auto' chooses every layer itself and cannot be combined with other entries ({others})",
            "give ckpt.layers=auto alone, or name every layer",
        )])
    model = user_module(model)
    found = find_blocks(model)
    if isinstance(found, Problem):
        raise_problems([found])
    chosen, rule = found
    named = [(n, m) for n, m in model.named_modules() if n]
    return chosen, f"ckpt.layers=auto chose {', '.join(chosen)} ({rule}): {_modules(_count(named, chosen))}"


# ---------------------------------------------------------------------- selection

def select_layers(model: nn.Module, layers: str | Sequence[str], every_n: int = 1) -> list[str]:
    """Qualified names of the modules to wrap, in the model's order.

    Raises :class:`~ckpt_plugin.errors.ConfigError` (a ``ValueError``) naming
    every entry of ``ckpt.layers`` that matched nothing, or an ``every_n`` that
    keeps none of the matches. The root module itself is never a candidate, and
    a match nested inside another match is dropped (checkpointing inside a
    checkpointed region only adds recompute). ``layers`` may be ``auto``
    (:func:`resolve_layers`); ``model`` may be wrapped (compiled, DDP, FSDP,
    Fabric): names are those of the module inside.
    """
    model = user_module(model)
    layers, _ = resolve_layers(model, layers)
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    modules = dict(named)
    problems: list[Problem] = []
    selectors = [s for s in (_parse(t, names, problems) for t in layers) if s]

    chosen: set[str] = set()
    for sel in selectors:
        hits = {n for n, m in named if sel.matches(n, m)}
        # A container without a forward (ModuleList, ModuleDict) is never called: not a candidate.
        called = {n for n in hits if has_forward(modules[n])}
        if not hits:
            problems.append(sel.nothing_matched(model, names))
        elif not called:  # "blocks", the ModuleList: wrapping it would checkpoint nothing
            problems.append(_never_called(sel.text, [n for n in names if n in hits], modules))
        chosen |= called
    raise_problems(problems, "ckpt.layers")

    outermost = [n for n in names if n in chosen and not _has_ancestor_in(n, chosen)]
    kept = [n for i, n in enumerate(outermost) if (i + 1) % every_n == 0]
    if not kept:
        raise_problems([Problem(
            "ckpt.every_n",
            f"ckpt.every_n={every_n} keeps none of the {len(outermost)} matched layers ({_shown(outermost)})",
            f"use a value from 1 to {len(outermost)}",
        )])
    return kept


def _never_called(text: str, hits: list[str], modules: dict[str, nn.Module]) -> Problem:
    classes = ", ".join(sorted({type(modules[n]).__name__ for n in hits}))
    one = len(hits) == 1
    return Problem(
        "ckpt.layers",
        f"ckpt.layers: {text!r} selects only {_shown(hits)} ({classes}), which {'has' if one else 'have'} no "
        f"forward: nothing calls {'it' if one else 'them'}, so checkpointing would do nothing",
        f"select the modules inside, e.g. '{hits[0]}.*'",
    )


def _has_ancestor_in(name: str, chosen: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in chosen for i in range(1, len(parts)))


__all__ = ["AUTO", "resolve_layers", "select_layers"]

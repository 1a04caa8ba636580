"""Which modules of a model ``ckpt.layers`` and ``ckpt.every_n`` select.

Each entry of ``ckpt.layers`` is read by its shape:

==========================  =============================================
``TransformerBlock``        modules whose class is named exactly that
``pkg.models.Block``        the submodule of that qualified name if there
                            is one, else instances of the imported class
                            (subclasses included)
``blocks.*``, ``*.attn``    module names matching the glob (``*?[``)
``re:blocks\\.[0-9]+``      module names fully matching the regex
==========================  =============================================

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
        classes = {type(m).__name__ for m in model.modules()}
        return Problem(
            "ckpt.layers",
            f"ckpt.layers: no module of class {self.text!r} in {type(model).__name__}",
            f"class names in this model, closest first: {_shown(closest_first(self.text, classes))}",
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
    """``blocks.3``: the submodule of exactly that qualified name."""

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
    if "." not in text:
        return ClassName(text)
    if text in names:
        return ModuleName(text)
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


def select_layers(model: nn.Module, layers: Sequence[str], every_n: int = 1) -> list[str]:
    """Qualified names of the modules to wrap, in the model's order.

    Raises :class:`~ckpt_plugin.errors.ConfigError` (a ``ValueError``) naming
    every entry of ``ckpt.layers`` that matched nothing, or an ``every_n`` that
    keeps none of the matches. The root module itself is never a candidate, and
    a match nested inside another match is dropped (checkpointing inside a
    checkpointed region only adds recompute).
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    problems: list[Problem] = []
    selectors = [s for s in (_parse(t, names, problems) for t in layers) if s]

    chosen: set[str] = set()
    for sel in selectors:
        hits = {n for n, m in named if sel.matches(n, m)}
        if not hits:
            problems.append(sel.nothing_matched(model, names))
        chosen |= hits
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


def _has_ancestor_in(name: str, chosen: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in chosen for i in range(1, len(parts)))


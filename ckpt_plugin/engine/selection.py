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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from ckpt_plugin.errors import closest_first, raise_problems

_SHOWN = 12  # how many existing names an error lists before "..."


@dataclass(frozen=True)
class _Selector:
    text: str
    test: Callable[[str, nn.Module], bool]
    what: str  # for errors: "class name", "glob", ...


def _shown(names: list[str]) -> str:
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _import_class(path: str) -> type | None:
    """The class at ``path``, or None when it does not import or is not a class."""
    module_path, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return obj if isinstance(obj, type) else None


def _parse(text: str, names: list[str], problems: list[str]) -> _Selector | None:
    if text.startswith("re:"):
        try:
            pattern = re.compile(text[3:])
        except re.error as err:
            problems.append(f"ckpt.layers: {text!r} is not a valid regular expression ({err})")
            return None
        return _Selector(text, lambda name, _m: pattern.fullmatch(name) is not None, "regex")
    if any(c in text for c in "*?["):
        return _Selector(text, lambda name, _m: fnmatch.fnmatchcase(name, text), "glob")
    if "." not in text:
        return _Selector(text, _has_class_named(text), "class name")
    if text in names:
        return _Selector(text, lambda name, _m: name == text, "module name")
    cls = _import_class(text)
    if cls is None:
        problems.append(
            f"ckpt.layers: {text!r} is neither a module name in the model nor an importable class "
            f"(write a class as 'package.module.ClassName'); module names, closest first: "
            f"{_shown(closest_first(text, names))}"
        )
        return None
    return _Selector(text, lambda _n, module: isinstance(module, cls), "class path")


def _nothing_matched(sel: _Selector, model: nn.Module, names: list[str]) -> str:
    if sel.what == "class name":
        classes = {type(m).__name__ for m in model.modules()}
        return (
            f"ckpt.layers: no module of class {sel.text!r} in {type(model).__name__}; "
            f"class names in this model, closest first: {_shown(closest_first(sel.text, classes))}"
        )
    if sel.what == "class path":
        return (
            f"ckpt.layers: no module in {type(model).__name__} is an instance of {sel.text!r}; "
            f"class names in this model: {_shown(sorted({type(m).__name__ for m in model.modules()}))}"
        )
    return (
        f"ckpt.layers: the {sel.what} {sel.text!r} matches no module name in "
        f"{type(model).__name__}; module names, closest first: {_shown(closest_first(sel.text, names))}"
    )


def _has_class_named(text: str) -> Callable[[str, nn.Module], bool]:
    # The class or a base: FSDP2's fully_shard swaps a module's class for a subclass
    # (TransformerBlock -> FSDPTransformerBlock) that must still match its own name.
    return lambda _n, module: any(c.__name__ == text for c in type(module).__mro__)


def select_layers(model: nn.Module, layers: Sequence[str], every_n: int = 1) -> list[str]:
    """Qualified names of the modules to wrap, in the model's order.

    Raises ``ValueError`` naming every entry of ``ckpt.layers`` that matched
    nothing, or an ``every_n`` that keeps none of the matches. The root module
    itself is never a candidate, and a match nested inside another match is
    dropped (checkpointing inside a checkpointed region only adds recompute).
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    problems: list[str] = []
    selectors = [s for s in (_parse(t, names, problems) for t in layers) if s]

    chosen: set[str] = set()
    for sel in selectors:
        hits = {n for n, m in named if sel.test(n, m)}
        if not hits:
            problems.append(_nothing_matched(sel, model, names))
        chosen |= hits
    if problems:
        raise_problems(problems, "ckpt.layers")

    outermost = [n for n in names if n in chosen and not _has_ancestor_in(n, chosen)]
    kept = [n for i, n in enumerate(outermost) if (i + 1) % every_n == 0]
    if not kept:
        raise_problems(
            [
                f"ckpt.every_n={every_n} keeps none of the {len(outermost)} matched layers "
                f"({_shown(outermost)}); use a value from 1 to {len(outermost)}"
            ]
        )
    return kept


def _has_ancestor_in(name: str, chosen: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in chosen for i in range(1, len(parts)))


"""What a checkpointed call must not do twice: fill a KV cache, or change any other mutable argument.

Recomputation replays a layer's forward in backward, so whatever the forward
does besides computing its output happens twice. BatchNorm statistics are put
back by ``norms.py`` (pytorch#96136). This module handles the arguments (issue #14):

- A Hugging Face KV cache. Configs default to ``use_cache=True``, so a plain
  ``model(input_ids=..., labels=...)`` in training hands every decoder layer a
  ``Cache`` whose ``update`` appends the layer's keys and values; replayed, it
  appends them again (GPT-2 and Llama with padding then fail in backward, T5
  always, and Llama without a mask returns every layer's keys twice), and the
  cache keeps each layer's keys alive as activations. A call in training that
  will be recomputed gets its cache neutralised the way transformers' own
  ``GradientCheckpointingLayer`` (``transformers/modeling_layers.py``) does:
  ``use_cache=False``, ``past_key_values``/``past_key_value``/``layer_past``
  -> None, and any other argument, positional ones included (GPT-2 passes its
  cache second), that is a ``transformers`` ``Cache`` -> None; a layer class
  with ``_can_checkpoint_with_cache`` (one that only reads it) keeps its cache,
  as there. One warning per installation names the layer class. Transformers
  is never imported: a cache is recognised by a class named ``Cache`` from a
  ``transformers`` module in its MRO. In eval mode with grad enabled (evaluation
  without ``torch.no_grad()``), where Hugging Face does not checkpoint at all, a
  call given a cache runs without checkpointing, so the cache fills once.
- Any other mutable argument (a dict, list, set, object with a ``__dict__``):
  fingerprinted before the forward (identities, plain values and tensor
  versions, three levels deep, holding references so no id is reused) and
  compared after it; a forward that changed one raises at once, before any
  backward, naming the module, the argument and the fix. A list or dict of
  tensors and plain values is given as a copy, so a caller that changes it once
  the forward has returned (torchvision's DenseNet appends each dense layer's
  output to the list it passed) leaves the recomputation's unchanged.

The model above the layers gets ``use_cache=False`` too, in training with grad
enabled (:func:`turn_cache_off_above`), as transformers' models do when their own
checkpointing is on: a module above a wrapped layer whose ``forward`` takes
``use_cache`` and whose ``config`` has one. Its layers then never see a cache,
and it returns ``past_key_values=None``, exactly what Hugging Face returns.

Nothing happens under ``torch.no_grad()`` (no recomputation follows: generation
keeps and fills its cache), and a call given only tensors and plain values
pays one type lookup per argument.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import version

# Types a forward cannot change: the common call (tensors and flags) stops at one set lookup each.
_PLAIN_TYPES = frozenset({
    type(None), bool, int, float, complex, str, bytes, torch.Tensor, nn.Parameter, torch.dtype, torch.device,
    torch.Size, torch.layout, torch.memory_format, type(Ellipsis), range, slice,
})
_PLAIN_BASES = (
    torch.Tensor, nn.Module, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum, type,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType,
)  # nn.Module: its own state is not an argument's (BatchNorm statistics: norms.py)
# The names transformers' GradientCheckpointingLayer clears ("different names for the same thing").
_CACHE_NAMES = frozenset({"past_key_values", "past_key_value", "layer_past"})
_WATCHED_KEYS = _CACHE_NAMES | {"use_cache"}
_DEPTH = 3  # how far into nested containers a fingerprint looks

_PLAIN, _CACHE, _MUTABLE = "plain", "cache", "mutable"


def is_hf_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers ``Cache`` (without importing transformers)."""
    return any(c.__name__ == "Cache" and c.__module__.partition(".")[0] == "transformers" for c in type(value).__mro__)


def _kind(value: Any, depth: int = _DEPTH) -> str:
    if type(value) in _PLAIN_TYPES or isinstance(value, _PLAIN_BASES):
        return _PLAIN
    if is_hf_cache(value):
        return _CACHE
    if isinstance(value, (tuple, frozenset)) and depth > 0:
        return _PLAIN if all(_kind(v, depth - 1) == _PLAIN for v in value) else _MUTABLE
    return _MUTABLE


def _fingerprint(value: Any, keep: list, depth: int = _DEPTH) -> Any:
    """What a change to ``value`` would change: ids, plain values and tensor versions; ``keep`` holds
    every object whose id is used, so none is freed and its id reused before the comparison."""
    if isinstance(value, torch.Tensor):
        keep.append(value)
        return id(value), version(value)  # bumped by every in-place write
    if type(value) in _PLAIN_TYPES:
        return value
    keep.append(value)
    if depth == 0 or isinstance(value, nn.Module):
        return id(value)
    if isinstance(value, dict):
        return id(value), tuple((_fingerprint(k, keep, 0), _fingerprint(v, keep, depth - 1)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return id(value), tuple(_fingerprint(v, keep, depth - 1) for v in value)
    if isinstance(value, (set, frozenset)):
        return id(value), frozenset(_fingerprint(v, keep, 0) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, _PLAIN_BASES):
        return id(value), _fingerprint(vars(value), keep, depth - 1)
    return id(value)


def _needs_a_look(args: tuple, kwargs: dict) -> bool:
    """Whether any argument may be a cache or mutable (the fast path: only tensors and plain values)."""
    for a in args:
        if type(a) not in _PLAIN_TYPES:
            return True
    for k, v in kwargs.items():
        if type(v) not in _PLAIN_TYPES or k in _WATCHED_KEYS:
            return True
    return False


@dataclass
class Watched:
    where: int | str  # position or keyword
    value: Any
    fingerprint: Any
    keep: list


@dataclass
class Prepared:
    """One call's arguments, made safe to replay, and what to check after its forward."""

    args: tuple
    kwargs: dict
    changed: bool = False  # args or kwargs differ from what the caller passed
    uncheckpointed: bool = False  # run the forward plainly (a cache in eval mode)
    watched: list[Watched] = field(default_factory=list)

    def check(self, label: str, forward: Callable[..., Any], training: bool) -> None:
        """Raise if the forward changed an argument it was given (``label``: ``"blocks.0 (Block)"``)."""
        for w in self.watched:
            if _fingerprint(w.value, []) != w.fingerprint:
                where = f"{_parameter_name(forward, w.where)!r}" if isinstance(w.where, int) else repr(w.where)
                hint = "" if training else " (Or, with no backward to follow, run it under torch.no_grad().)"
                raise RuntimeError(
                    f"{label} changed its argument {where} ({type(w.value).__name__}) during its forward; the "
                    f"recomputation in backward would change it a second time. Make the forward leave it "
                    f"unchanged, pass it outside the checkpointed layer, or leave this layer out of "
                    f"ckpt.layers.{hint}"
                )


def _is_cache_argument(where: int | str, value: Any) -> bool:
    """Whether a checkpointed training call gets None for this argument (position or keyword): a
    transformers cache, or anything passed under a cache's name."""
    return value is not None and (where in _CACHE_NAMES or is_hf_cache(value))


@contextlib.contextmanager
def cache_warnings_silenced() -> Iterator[None]:
    """Measuring runs (``ckpt=auto``'s profile and timing) wrap layers for a moment, and each of those
    installations would warn about the KV cache once; the installation that follows warns the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"ckpt_plugin: .*KV cache", category=UserWarning)
        yield


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` as a checkpointed training call gets them: no KV cache, ``use_cache=False``.

    For a layer run again and again on one captured call (``planning/timing.py`` times each option
    on the model's sample input): a transformers cache given to it would grow on every run.
    """
    args = tuple(None if _is_cache_argument(i, a) else a for i, a in enumerate(args))
    kwargs = {k: None if _is_cache_argument(k, v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _snapshot(value: Any) -> Any:
    """A list or dict of tensors and plain values, copied (one level): what the recomputation replays.

    The caller may change it once the forward has returned: torchvision's DenseNet hands each dense
    layer the list of the features so far, then appends that layer's output to the very same list.
    The recomputation must see the list as the forward did. Anything else is given as it is.
    """
    if type(value) is list and _kind(tuple(value)) == _PLAIN:
        return list(value)
    if type(value) is dict and _kind(tuple(value.values())) == _PLAIN:
        return dict(value)
    return value


def _parameter_name(forward: Callable[..., Any], position: int) -> str:
    """The name of ``forward``'s positional parameter ``position`` (``"#2"`` when unknown)."""
    try:
        params = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[position].name if position < len(params) else f"#{position}"


class SideEffects:
    """The argument checks of one installation (one ``install``): it warns about the cache once."""

    __slots__ = ("warned",)

    def __init__(self) -> None:
        self.warned = False

    def prepare(self, module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Prepared | None:
        """The arguments a checkpointed call of ``module`` runs with; None: the caller's, unchecked.

        Call it only for a call that checkpoints; it returns None at once unless grad is
        enabled (no recomputation can follow) and some argument is not a tensor or plain value.
        """
        if not torch.is_grad_enabled() or not _needs_a_look(args, kwargs):
            return None
        training = module.training
        keep_cache = getattr(module, "_can_checkpoint_with_cache", False)  # transformers' opt-out for readers
        prepared = Prepared(args, dict(kwargs))
        changes: list[str] = []
        new_args = list(args)
        items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
        for where, value in items:
            kind = _kind(value)
            if not training:
                if kind == _CACHE:  # Hugging Face does not checkpoint in eval: neither do we, for this call
                    return Prepared(args, kwargs, uncheckpointed=True)
            elif where == "use_cache":
                if value:
                    prepared.kwargs[where] = False
                    changes.append("use_cache=False")
                continue
            elif not keep_cache and _is_cache_argument(where, value):
                if isinstance(where, int):
                    new_args[where] = None
                else:
                    prepared.kwargs[where] = None
                changes.append(f"{_parameter_name(forward, where) if isinstance(where, int) else where}=None")
                continue
            if kind != _PLAIN:
                value = _snapshot(value)
                if isinstance(where, int):
                    new_args[where] = value
                else:
                    prepared.kwargs[where] = value
                keep: list = []
                prepared.watched.append(Watched(where, value, _fingerprint(value, keep), keep))
        prepared.args = tuple(new_args)
        prepared.changed = any(a is not b for a, b in zip(prepared.args, args)) or any(
            prepared.kwargs[k] is not v for k, v in kwargs.items())
        if changes:
            self._warn(module, changes)
        return prepared if prepared.changed or prepared.watched else None

    def warn_model(self, model: nn.Module) -> None:
        self._warn_once(
            f"ckpt_plugin: {type(model).__name__} has checkpointed layers and is training, so it runs with "
            f"use_cache=False and returns no KV cache, as with Hugging Face's own gradient checkpointing: "
            f"the recomputation in backward would fill the cache a second time.")

    def _warn(self, module: nn.Module, changes: list[str]) -> None:
        self._warn_once(
            f"ckpt_plugin: {type(module).__name__} is checkpointed in training, so its KV cache is not filled "
            f"({', '.join(changes)}), as Hugging Face's own gradient checkpointing does: the recomputation "
            f"in backward would fill it a second time.")

    def _warn_once(self, message: str) -> None:
        """One warning per installation, whichever of the model or a layer meets the cache first."""
        if not self.warned:
            self.warned = True
            warnings.warn(message, UserWarning, stacklevel=4)


HOOK_ATTR = "_ckpt_plugin_cache_off"  # where a module keeps its use_cache=False hook's handle (not in state_dict)


def _use_cache_position(module: nn.Module) -> int | None:
    """Where ``use_cache`` sits among the positional parameters of a Hugging Face-style module's forward;
    None: its forward takes no ``use_cache`` or it has no ``config.use_cache`` (not such a module)."""
    if getattr(getattr(module, "config", None), "use_cache", None) is None:
        return None
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    return names.index("use_cache") if "use_cache" in names else None


def turn_cache_off_above(model: nn.Module, wrapped: list[str], side_effects: SideEffects) -> list[str]:
    """Hook ``use_cache=False`` (in training, grad enabled) into every module above a wrapped layer that
    takes it; returns their names. :func:`remove_cache_hooks` takes the hooks off."""
    above = {".".join(name.split(".")[:i]) for name in wrapped for i in range(len(name.split(".")))}
    hooked = []
    for name, module in model.named_modules():
        position = _use_cache_position(module) if name in above else None
        if position is None:
            continue

        def hook(m: nn.Module, args: tuple, kwargs: dict, position: int = position) -> tuple | None:
            if not (m.training and torch.is_grad_enabled()) or len(args) > position:
                return None  # not recomputed, or use_cache passed positionally: the layers neutralise it
            use_cache = kwargs.get("use_cache")
            if use_cache or (use_cache is None and m.config.use_cache):  # None: the config decides, in HF
                side_effects.warn_model(m)
            return args, {**kwargs, "use_cache": False}

        module.__dict__[HOOK_ATTR] = module.register_forward_pre_hook(hook, with_kwargs=True)
        hooked.append(name)
    return hooked


def remove_cache_hooks(model: nn.Module) -> None:
    for module in model.modules():
        handle = module.__dict__.pop(HOOK_ATTR, None)
        if handle is not None:
            handle.remove()


__all__ = ["HOOK_ATTR", "Prepared", "SideEffects", "is_hf_cache", "remove_cache_hooks", "turn_cache_off_above"]

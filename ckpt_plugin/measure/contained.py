"""Run the user's step for a measurement and leave no trace a user could see (issue #42, item 3).

    with contained(model) as kept:
        loss = step()          # training_step on fake tensors, or timed on real ones
    kept.uncontained           # what could not be put back (said once by the caller), [] mostly

Measuring runs the user's code more often than training does: ``ckpt=auto``'s
profile, its timing, the report and the over-keeping check each run the step the
trainer runs. A ``training_step`` that counts its calls, updates an EMA held in an
attribute, appends to a history or draws random numbers must not see those runs.
So around each one, the module's own state is put back as it was:

- every module's plain attributes (numbers, strings, lists, dicts, sets, deques
  and plain objects, at any depth; not what can be called: functions, methods,
  the plugin's own forward wrappers): each is copied before and written back after,
  into the same object where it is a container or a plain object (a list the user
  holds elsewhere sees its old contents again); attributes the step added are
  removed. Tensors inside them are kept by reference (a history of detached
  losses is not copied), and one written in place is put back from a copy taken
  before (up to :data:`_COPIED_TENSOR_BYTES`; a larger one is said, not copied:
  measuring must not spend the memory it exists to save);
- the random streams of torch (CPU and CUDA), Python and NumPy.

Buffers (BatchNorm statistics) are put back where real tensors run
(``measure.memory.side_effect_free``); on fake tensors nothing real is written.

Submodules, hooks and the frameworks' own objects (the trainer, a device, a
generator) are not the step's to change and are not copied. An attribute that cannot be copied (a
lock, a file, a generator) is listed in ``uncontained``: its changes stay.
Effects outside the module (a global, a file written) cannot be seen here at all;
the docs say so, with the key that runs no measurement (``ckpt.sample``).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import beneath_dispatch_modes, version

# What nn.Module keeps in its __dict__ for itself (its registries and hooks, ``training``): never a step's to change.
_MODULE_OWN = frozenset(vars(nn.Module()))
# Objects of the frameworks (a Trainer, a Fabric, a device, a generator) are not the step's state: kept by reference.
_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
_COPIED_TENSOR_BYTES = 16 << 20  # a tensor attribute up to this size is copied, to be put back if written in place


@dataclass
class Kept:
    """What :func:`contained` copied, and what it could not."""

    uncontained: list[str] = field(default_factory=list)  # "blocks.0.lock (RLock)": its changes stay


def _snapshot(value: Any, tensors: list[tuple[torch.Tensor, torch.Tensor | None, int]]) -> Any:
    """A copy of ``value`` deep in its containers and plain objects, its tensors by reference (each noted in
    ``tensors`` with a copy where small, and its version counter)."""
    if isinstance(value, torch.Tensor):
        small = value.numel() * value.element_size() <= _COPIED_TENSOR_BYTES
        with beneath_dispatch_modes():  # no op of the step: a memory tracker around it must not count the copy
            before = value.detach().clone() if small else None
        tensors.append((value, before, version(value)))
        return value
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return type(value)(_snapshot(v, tensors) for v in value) if not _is_namedtuple(value) else \
            type(value)(*(_snapshot(v, tensors) for v in value))
    if isinstance(value, dict):
        copied = copy.copy(value)  # its type (OrderedDict, defaultdict) and default factory
        copied.clear()
        copied.update((k, _snapshot(v, tensors)) for k, v in value.items())
        return copied
    if isinstance(value, (nn.Module, type)) or callable(value):
        # Code is no state: a function, a bound method (deepcopy would copy its module), a wrapper the plugin set as
        # the module's forward (engine/forwards.py), a loss object; kept as it is.
        return value
    if not hasattr(value, "__dict__"):
        return copy.deepcopy(value)  # numbers, strings, None, enums, arrays
    copied = copy.copy(value)
    copied.__dict__.update((k, _snapshot(v, tensors)) for k, v in vars(value).items())
    return copied


def _framework_object(value: Any) -> bool:
    """An object of torch's or Lightning's own classes other than a tensor or a container (a Trainer, a device)."""
    if isinstance(value, (torch.Tensor, list, tuple, dict, set, collections.deque)):
        return False
    return type(value).__module__.split(".")[0] in _FRAMEWORKS


def _framework_module(module: nn.Module) -> bool:
    """A module of torch's or Lightning's own classes only (``nn.Linear``, FSDP's wrapper): its attributes are the
    framework's bookkeeping (FSDP's state between forward and backward), never the step's to have changed. A user's
    class in its lineage (FSDP2's ``FSDPBlock`` subclasses the user's ``Block``) makes it the user's."""
    return all(c.__module__.split(".")[0] in _FRAMEWORKS for c in type(module).__mro__ if c is not object)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _restore_into(current: Any, saved: Any) -> Any:
    """``saved``'s value, written into ``current`` where both are the same kind of container or plain object (so
    that every holder of ``current`` sees it), else ``saved`` itself to be assigned."""
    if current is saved:  # kept by reference (code, a framework's object): nothing to write back
        return current
    if type(current) is not type(saved):
        return saved
    if isinstance(current, list):
        current[:] = saved
        return current
    if isinstance(current, (dict, set)):
        current.clear()
        current.update(saved)
        return current
    if isinstance(current, collections.deque):
        current.clear()
        current.extend(saved)
        return current
    if hasattr(current, "__dict__") and not isinstance(current, (nn.Module, torch.Tensor, type)):
        current.__dict__.clear()
        current.__dict__.update(saved.__dict__)
        return current
    return saved


@contextlib.contextmanager
def contained(model: nn.Module) -> Iterator[Kept]:
    """Run the block, then put ``model``'s state and the random streams back as they were (the module's docstring)."""
    kept = Kept()
    attributes: list[tuple[nn.Module, dict[str, Any]]] = []
    tensors: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []  # (held, its copy or None, its version)
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        if _framework_module(module):
            continue
        saved: dict[str, Any] = {}
        for key, value in vars(module).items():
            if key in _MODULE_OWN or isinstance(value, nn.Module) or _framework_object(value):
                continue
            where = f"{name + '.' if name else ''}{key}"
            try:
                before = len(tensors)
                saved[key] = _snapshot(value, tensors)
                names.update((id(t), where) for t, _, _ in tensors[before:])
            except Exception:  # noqa: BLE001 -- a lock, a file, a generator: said, and left as it is
                kept.uncontained.append(f"{where} ({type(value).__name__})")
                saved[key] = value
        attributes.append((module, saved))
    python, numpy = random.getstate(), sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield kept
    finally:
        random.setstate(python)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
        with torch.no_grad(), beneath_dispatch_modes():
            for tensor, before, before_version in tensors:
                if version(tensor) == before_version:
                    continue
                if before is None:  # written in place, too large to have been copied
                    kept.uncontained.append(f"{names.get(id(tensor), 'a tensor')} (a tensor written in place)")
                else:
                    tensor.copy_(before)
        for module, saved in attributes:
            for key in [k for k, v in vars(module).items() if k not in saved and k not in _MODULE_OWN
                        and not isinstance(v, nn.Module) and not _framework_object(v)]:
                del module.__dict__[key]  # added by the step
            for key, value in saved.items():
                module.__dict__[key] = _restore_into(module.__dict__.get(key), value)


__all__ = ["Kept", "contained"]

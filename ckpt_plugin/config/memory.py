"""``ckpt.memory`` and ``ckpt.batch``: the device memory the whole step must fit, and the batch searched for in it.

    ckpt.memory=70GiB     ckpt.memory='70 GiB'     ckpt.memory=500MB     (a size, as ckpt.budget's: units.py)
    ckpt.memory=device    (the accelerator's total memory less a 5% margin: 0.95 of it)
    ckpt.memory=0.9       ckpt.memory=90%          (that share of the accelerator's total memory: your own margin)
    ckpt.batch=max        (the largest micro-batch whose whole step fits ckpt.memory; null: the dataloader's)

``ckpt.budget`` counts the activations alone; ``ckpt.memory`` counts everything one rank holds in a
step: parameters, gradients, optimizer state, activations and temporaries. ckpt=auto takes one of the
two (``schema.py`` says so). A share of the device's memory is resolved where the device is known
(:func:`resolve_memory`), on CUDA only: elsewhere no total is reported, and it must be a size.

Typed in a config or on a command line (``typed=True``, through ``check_app_config``), an integer
below 1 MiB other than 1 is refused as ckpt.budget's is: ``ckpt.memory=70`` means 70GiB far more often
than 70 bytes. The int 1 (what ``ckpt.memory=1`` gives) is the whole device, as 1.0 is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.units import LEAST_TYPED_BYTES, SIZE_UNITS, format_bytes, parse_size

if TYPE_CHECKING:  # torch is imported by resolve_memory only: the schema imports this module
    import torch

DEVICE = "device"
DEVICE_SHARE = 0.95  # ckpt.memory=device: the allocator's fragmentation and the CUDA context need the rest
MAX = "max"

_FORMS = ("a size (70GiB, '70 GiB', 500MB, or an integer number of bytes), device (the accelerator's total memory "
          "less a 5% margin) or a fraction of that total (0.9, 90%)")
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def _exact(n: int) -> str | None:
    """``n`` bytes as one unit says them exactly (70 GiB, 500 MB), else None."""
    for name, unit in (*_BINARY, *_DECIMAL):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return None


@dataclass(frozen=True)
class Memory:
    """``ckpt.memory``: bytes, or a fraction of the accelerator's total memory (resolved by :func:`resolve_memory`)."""

    bytes: int | None = None
    fraction: float | None = None
    device: bool = field(default=False, compare=False)  # typed as `device`: 0.95 as the plugin's margin, not yours

    def __str__(self) -> str:
        if self.bytes is not None:
            exact = _exact(self.bytes)
            if exact is not None:
                return exact
            return f"{self.bytes} B" if self.bytes < 1024 else f"{self.bytes} bytes ({format_bytes(self.bytes)})"
        share = f"{self.fraction:g} of the device's memory"
        return f"device ({share})" if self.device else share

    @property
    def typed(self) -> str:
        """The value as a command line would give it back: ``ckpt.memory=<typed>``."""
        if self.bytes is not None:
            exact = _exact(self.bytes)
            return exact.replace(" ", "") if exact else f"{self.bytes}B"
        return DEVICE if self.device else f"{self.fraction:g}"


def _wrong(problem: str, fix: str = "") -> ConfigError:
    """What is wrong with ``ckpt.memory``, as the error to raise: each ends with the valid forms."""
    forms = f"valid: {_FORMS}"
    return ConfigError([Problem("ckpt.memory", problem, f"{fix}; {forms}" if fix else forms)])


def _not_positive(given: Any) -> ConfigError:
    return _wrong(f"ckpt.memory={given!r} must be positive")


def _fraction(value: float, given: Any, percent: bool = False) -> Memory:
    if math.isnan(value) or value <= 0:
        raise _not_positive(given)
    if value > 1:
        fix = "at most 100%" if percent else (
            f"for a size write e.g. {value:g}GiB" if math.isfinite(value) else "for a size write e.g. 70GiB")
        raise _wrong(f"ckpt.memory={given!r}: a fraction of the device's memory must be in (0, 1]", fix)
    return Memory(fraction=float(value))


def parse_memory(value: Any, *, typed: bool = False) -> Memory:
    """``"70GiB"``, ``"70 GiB"``, ``"500MB"``, an int of bytes, ``"device"``, ``0.9`` or ``"90%"``.

    ``typed``: the value was typed in a config, where an int below 1 MiB (but 1) is a slip. Anything
    else raises a :class:`ConfigError` about ``ckpt.memory`` naming the value and these forms.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _wrong(f"ckpt.memory={value!r} ({type(value).__name__}) must be a size (70GiB), device or a "
                     "fraction (0.9)")
    if isinstance(value, int):
        if value <= 0:
            raise _not_positive(value)
        if typed and 1 < value < LEAST_TYPED_BYTES:  # a slip, not bytes: see the docstring
            raise _wrong(f"ckpt.memory={value} would be {value} bytes (an integer is a number of bytes): did you "
                         "mean a size with a unit?", f"write e.g. {value}GiB, device or 0.9, or {value}B if "
                         f"{value} bytes are meant")
        return Memory(fraction=1.0) if value == 1 else Memory(bytes=value)
    if isinstance(value, float):
        return _fraction(value, value)
    text = value.strip().replace("_", "")
    if text.lower() == DEVICE:
        return Memory(fraction=DEVICE_SHARE, device=True)
    number = text[:-1] if text.endswith("%") else text
    try:
        share = float(number)
    except ValueError:
        pass
    else:
        return _fraction(share / 100 if number is not text else share, value, percent=number is not text)
    size = parse_size(text)
    if size is None:
        if text.startswith("-"):
            raise _not_positive(value)
        raise ConfigError([Problem("ckpt.memory", f"ckpt.memory={value!r} is not a memory: write {_FORMS}",
                                   f"a size's unit is {SIZE_UNITS}")])
    if size <= 0:
        raise _not_positive(value)
    return Memory(bytes=size)


def resolve_memory(memory: Memory, device: torch.device | str) -> int:
    """``memory`` in bytes on ``device``: a size as it is, a fraction of the CUDA device's total memory.

    On any other device a fraction (or ``device``) is a :class:`ConfigError`: no total memory is
    reported there to take a share of, so the memory must be given as a size.
    """
    if memory.bytes is not None:
        return memory.bytes
    import torch  # here only: the schema imports this module, and imports no torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError([Problem(
            "ckpt.memory",
            f"ckpt.memory={memory.typed} is a share of the accelerator's total memory, which a {device.type} "
            f"device does not report: on {device.type} ckpt.memory must be given as a size",
            "e.g. ckpt.memory=8GiB (the memory the whole step may use on one rank)",
        )])
    return int(memory.fraction * torch.cuda.get_device_properties(device).total_memory)


def batch_problems(batch: Any, memory_given: bool) -> list[Problem]:
    """``ckpt.batch``: null (the dataloader's batch) or max, which searches the batch against ``ckpt.memory``."""
    if batch is None:
        return []
    if batch != MAX:
        fix = f"a batch size of {batch} is the dataloader's own setting (its batch_size)" if isinstance(
            batch, int) and not isinstance(batch, bool) else ""
        return [Problem(
            "ckpt.batch",
            f"ckpt.batch={batch!r} ({type(batch).__name__}) must be null (the batch the dataloader has) or max "
            "(the largest micro-batch whose whole step fits ckpt.memory)", fix)]
    if not memory_given:
        return [Problem(
            "ckpt.batch",
            "ckpt.batch=max needs ckpt.memory: the device memory the whole step must fit (70GiB, device), which "
            "the largest micro-batch is searched against",
            "set ckpt.memory, or drop ckpt.batch to train on the dataloader's batch")]
    return []


__all__ = ["DEVICE", "DEVICE_SHARE", "MAX", "Memory", "batch_problems", "parse_memory", "resolve_memory"]

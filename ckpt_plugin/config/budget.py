"""``ckpt.budget``: a fraction of the activation peak without checkpointing, or a size.

    ckpt.budget=0.4     ckpt.budget=40%     ckpt.budget=2GiB     ckpt.budget='2 GiB'     ckpt.budget=300MB
    ckpt.budget=min     (the least activation peak the planner reaches, whatever it is)

A size is a number and a unit (B, KB, MB, GB, TB powers of 1000; KiB, MiB, GiB,
TiB powers of 1024), in any case, with or without a space between them, or an
integer number of bytes: read as ckpt.memory's are (``units.py``). Anything else is a :class:`~ckpt_plugin.errors.ConfigError`
naming ``ckpt.budget``, the value and these forms: a budget never falls back to a default.

Typed in a config or on a command line (``typed=True``: Hydra apps, through
``check_app_config``), an integer below 1 MiB other than 1 is refused too:
``ckpt.budget=2`` is a slip for "2 GB" or "0.2" far more often than a budget of
two bytes. In Python a computed byte count (``budget=peak // 2``) may be any size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.units import LEAST_TYPED_BYTES, SIZE_UNITS, format_bytes, parse_size

# ckpt=auto takes ckpt.memory instead (config/memory.py): an unset budget names both.
_NEEDS_BUDGET = (
    "ckpt=auto needs ckpt.budget: a fraction of the activation peak without checkpointing (0.4) or a size (2GiB), "
    "or ckpt.memory: the device memory for the whole step (70GiB, device)"
)


# ---------------------------------------------------------------------- the budget

@dataclass(frozen=True)
class Budget:
    """``ckpt.budget``: a fraction of the activation peak without checkpointing, or bytes."""

    fraction: float | None = None
    bytes: int | None = None
    least: bool = False  # ckpt.budget=min: the least peak the planner reaches, at the least cost for it

    def __str__(self) -> str:
        if self.least:
            return "the least activation peak reachable"
        return f"{self.fraction:g} of the activation peak" if self.fraction is not None else format_bytes(self.bytes)


LEAST = "min"
_FORMS = ("a fraction of the activation peak without checkpointing (0.4, 40%), a size "
          "(2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least peak reachable)")


def _wrong(problem: str, fix: str = "") -> ConfigError:
    """What is wrong with ``ckpt.budget``, as the error to raise: each ends with the valid forms."""
    forms = f"valid: {_FORMS}"
    return ConfigError([Problem("ckpt.budget", problem, f"{fix}; {forms}" if fix else forms)])


def _not_positive(given: Any) -> ConfigError:
    return _wrong(f"ckpt.budget={given!r} must be positive")


def _fraction(value: float, given: Any, percent: bool = False) -> Budget:
    if math.isnan(value) or value <= 0:
        raise _not_positive(given)
    if value > 1:
        size = "at most 100%" if percent else f"for a size write e.g. {value:g}GiB" if value < 1024 else (
            f"for a size write e.g. {value:.0f}B" if math.isfinite(value) else "for a size write e.g. 2GiB")
        raise _wrong(f"ckpt.budget={given!r}: a fraction must be in (0, 1]", size)
    return Budget(fraction=float(value))


def parse_budget(budget: Any, *, typed: bool = False) -> Budget:
    """``0.4``, ``"0.4"``, ``"40%"``, ``"2GiB"``, ``"2 GiB"``, ``"512MiB"``, ``"300MB"``, an int of bytes or ``"min"``.

    The int ``1`` (what ``ckpt.budget=1`` gives) is the whole peak, not one byte. ``typed``:
    the value was typed in a config, where any other int below 1 MiB is a slip (``2`` for "2 GB").
    Anything else raises a :class:`ConfigError` about ``ckpt.budget``.
    """
    if budget is None or budget == "???" or (isinstance(budget, str) and not budget.strip()):  # ??? is MISSING
        raise ConfigError([Problem("ckpt.budget", _NEEDS_BUDGET)])
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise _wrong(f"ckpt.budget={budget!r} ({type(budget).__name__}) must be a fraction (0.4) or a size (2GiB)")
    if isinstance(budget, int):
        if budget <= 0:
            raise _not_positive(budget)
        if typed and 1 < budget < LEAST_TYPED_BYTES:  # a slip, not bytes: see the docstring
            raise _wrong(f"ckpt.budget={budget} would be {budget} bytes (an integer is a number of bytes): "
                         "did you mean a fraction or a size with a unit?",
                         f"write e.g. 0.4, 40% or 2GiB, or {budget}B if {budget} bytes are meant")
        return Budget(fraction=1.0) if budget == 1 else Budget(bytes=budget)
    if isinstance(budget, float):
        return _fraction(budget, budget)
    text = budget.strip().replace("_", "")
    if text.lower() == LEAST:
        return Budget(least=True)
    number = text[:-1] if text.endswith("%") else text
    try:
        value = float(number)
    except ValueError:
        pass
    else:
        return _fraction(value / 100 if number is not text else value, budget, percent=number is not text)
    size = parse_size(text)
    if size is None:
        if text.startswith("-"):
            raise _not_positive(budget)
        raise ConfigError([Problem("ckpt.budget", f"ckpt.budget={budget!r} is not a budget: write {_FORMS}",
                                   f"a size's unit is {SIZE_UNITS}")])
    if size <= 0:
        raise _not_positive(budget)
    return Budget(bytes=size)


def cannot_meet(budget_bytes: int, least: int, reference: int, *, by: str, reaching: str = "reachable",
                hint: str = "") -> Problem:
    """The one way a budget no plan meets is said: the budget, the least peak ``by`` reaches, and a budget that
    can be typed back (a fraction rounded up so that it does reach, or bytes); ``least`` rides along as data.

    ``reference`` is the activation peak without checkpointing: the fractions are of it,
    and a budget of it always fits (everything kept), so the bytes typed back never exceed it.
    """
    fraction = math.ceil(least / reference * 100) / 100
    if int(fraction * reference) < least:  # the float's rounding, not the user's
        fraction += 0.01
    return Problem(
        "ckpt.budget",
        f"ckpt.budget: {budget_bytes} bytes ({format_bytes(budget_bytes)}, {budget_bytes / reference:.2f} of the "
        f"activation peak without checkpointing, {format_bytes(reference)}) cannot be met by {by}: the least peak "
        f"{reaching} is {least} bytes ({format_bytes(least)}, {least / reference:.2f}); raise ckpt.budget to at "
        f"least {min(fraction, 1):g} or {min(least, reference)}B{hint}",
        value=budget_bytes, least=least)


def resolve(budget: Budget, no_ckpt_peak_bytes: int) -> int:
    """The budget in bytes, given the activation peak of a step without checkpointing (not for ``min``)."""
    assert not budget.least, "ckpt.budget=min is planned for, not resolved: the planner finds its bytes"
    return budget.bytes if budget.bytes is not None else int(budget.fraction * no_ckpt_peak_bytes)

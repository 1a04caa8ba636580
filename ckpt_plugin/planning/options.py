"""What ``ckpt=auto`` may do to one layer (or one part of a layer): an :class:`Option`, a typed value.

    FULL                      # the layer checkpointed, keeping its inputs only
    SELECTIVE_NB              # checkpointed, saving what the matmuls_no_batch policy saves
    INSIDE.with_parts(2)      # left unwrapped, the 2nd choice of its parts checkpointed (inside.py)
    FULL.with_parts(1)        # full, the 1st choice of its parts checkpointed inside its recomputation
    str(FULL.with_parts(1))   # 'full+inside#1': how plans, plan files and messages name it
    parse("full+inside#1")    # back from that name: only where a name comes in from outside (a plan file)
    OFFLOAD, FULL_OFFLOAD     # 'offload', 'full+offload': what keep or full keeps, in host memory (offload_plan.py)

The planner, the profile and the timing decide by the fields; the names are
for people and files, and they are the ones plans have always printed.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace


class Itself(enum.Enum):
    """What an option does to the layer itself, whatever it does to the layer's parts."""

    KEEP = "keep"  # left as it is
    SELECTIVE = "selective"  # checkpointed, saving what a selective policy saves
    FULL = "full"  # checkpointed, keeping its inputs only
    INSIDE = "inside"  # left unwrapped, parts of it checkpointed


# Each selective policy (its ckpt.policy name) and the option's own name. ``selective`` saves every matmul's
# output, ``selective_nb`` only those without a batch dimension (JAX's ``dots_with_no_batch_dims_saveable``):
# a transformer block's linear layers kept, its attention recomputed. Between the two in what a block keeps;
# under torch.compile, where the recomputed attention fuses into the backward, it meets a budget between them
# for less than mixing ``selective`` with ``full`` (issue #22).
_SELECTIVE_NAMES = {"matmuls": "selective", "matmuls_no_batch": "selective_nb"}


@functools.total_ordering
@dataclass(frozen=True)
class Option:
    """One option of a layer: what it does to the layer itself and, for one inside it, which parts.

    ``policy``: for ``SELECTIVE``, the policy it saves by (``matmuls`` or
    ``matmuls_no_batch``). ``parts``: for an option with parts of the layer
    checkpointed (``INSIDE``, or ``FULL`` with them nested in its
    recomputation), which of the layer's choices of parts (``inside.py``
    numbers them from 1); None for the others. The choice's parts themselves
    are in its :class:`~ckpt_plugin.planning.planner.Cost`.
    """

    itself: Itself
    policy: str | None = None
    parts: int | None = None
    offload: bool = False  # what the layer keeps (keep: its saved tensors; full: its inputs) lives in host memory

    def __post_init__(self) -> None:
        assert (self.policy in _SELECTIVE_NAMES) == (self.itself is Itself.SELECTIVE), self
        assert self.parts is None or self.itself in (Itself.INSIDE, Itself.FULL) and self.parts >= 1, self
        assert not self.offload or self.itself in (Itself.KEEP, Itself.FULL) and self.parts is None, self

    @property
    def checkpoints(self) -> bool:
        """Whether the layer itself runs under a checkpoint (``selective`` or ``full``, parts inside or not)."""
        return self.itself in (Itself.SELECTIVE, Itself.FULL)

    @property
    def kind(self) -> Option:
        """What it does to the layer itself, without which parts: ``inside#2`` is ``inside``, ``full+inside#1``
        ``full``: how a plan lists the layer, its parts listed after it."""
        return replace(self, parts=None)

    def with_parts(self, k: int) -> Option:
        """This option with the ``k``-th choice of the layer's parts checkpointed too (``inside.py``)."""
        return replace(self, parts=k)

    def __lt__(self, other: Option) -> bool:
        # The planner's frontiers break exact ties by comparing choices, option by option: in the order of the
        # options' names (full < full+inside#1 < full+offload < inside#1 < keep < offload < selective <
        # selective_nb), as they always have, so that plans stay as they are.
        if not isinstance(other, Option):
            return NotImplemented
        return str(self) < str(other)

    def __str__(self) -> str:
        if self.offload:
            return "offload" if self.itself is Itself.KEEP else "full+offload"
        if self.parts is not None:
            return f"inside#{self.parts}" if self.itself is Itself.INSIDE else f"full+inside#{self.parts}"
        if self.itself is Itself.SELECTIVE:
            return _SELECTIVE_NAMES[self.policy]
        return self.itself.value


KEEP = Option(Itself.KEEP)
SELECTIVE = Option(Itself.SELECTIVE, "matmuls")
SELECTIVE_NB = Option(Itself.SELECTIVE, "matmuls_no_batch")
FULL = Option(Itself.FULL)
INSIDE = Option(Itself.INSIDE)  # a layer's kind where it runs unwrapped with parts checkpointed; parts: .with_parts(k)
OFFLOAD = Option(Itself.KEEP, offload=True)  # not checkpointed, its saved tensors in host memory
FULL_OFFLOAD = Option(Itself.FULL, offload=True)  # checkpointed, its inputs in host memory

# A layer's own options, in order of intrusiveness: ties in cost go to the earlier (planner.py).
OPTIONS = (KEEP, SELECTIVE, SELECTIVE_NB, FULL)
# Where a host link was measured (offload_plan.py): priced from keep's and full's costs, never stepped on their own.
OFFLOAD_OPTIONS = (OFFLOAD, FULL_OFFLOAD)
PART_OPTIONS = (KEEP, SELECTIVE, FULL)  # a layer's parts (inside.py): one memory step less per level

# Whether selective options are offered (a context's: ``without_selective``). Not under DeepSpeed ZeRO-3, whose
# memory-efficient linear is a custom autograd.Function: torch's selective checkpointing sees none of the matmuls
# inside one (pytorch#153334), and a selective region nested in a checkpointed layer fails its recomputation's
# metadata check ("Recomputed values ... have different metadata"), on real tensors as on fake ones.
_SELECTIVE = contextvars.ContextVar("ckpt_plugin_selective_offered", default=True)


@contextlib.contextmanager
def without_selective(drop: bool = True) -> Iterator[None]:
    """Plan without the selective options (``drop``; else as usual) while the context is open."""
    token = _SELECTIVE.set(not drop and _SELECTIVE.get())
    try:
        yield
    finally:
        _SELECTIVE.reset(token)


def offered(options: Iterable[Option]) -> list[Option]:
    """``options`` less the selective ones where they are not offered (:func:`without_selective`)."""
    return [o for o in options if _SELECTIVE.get() or o.itself is not Itself.SELECTIVE]


_NAMED = re.compile(r"(?:(?P<full>full\+)?inside#(?P<parts>[1-9][0-9]*))|(?P<own>[a-z_]+|full\+offload)")


def parse(name: str) -> Option:
    """The option ``name`` says (``str(option)`` gives it): for names from outside, a plan file's.

    Raises ValueError for a name no option has.
    """
    own = {str(o): o for o in (*OPTIONS, INSIDE, *OFFLOAD_OPTIONS)}
    match = _NAMED.fullmatch(name) if isinstance(name, str) else None
    if match is None or match["own"] is not None and match["own"] not in own:
        raise ValueError(f"{name!r} names no option of ckpt=auto; options: {', '.join(own)}, inside#<k>, "
                         "full+inside#<k>")
    if match["own"] is not None:
        return own[match["own"]]
    return (FULL if match["full"] else INSIDE).with_parts(int(match["parts"]))


__all__ = ["FULL", "FULL_OFFLOAD", "INSIDE", "KEEP", "OFFLOAD", "OFFLOAD_OPTIONS", "OPTIONS", "Itself", "Option",
           "PART_OPTIONS", "SELECTIVE", "SELECTIVE_NB", "offered", "parse", "without_selective"]

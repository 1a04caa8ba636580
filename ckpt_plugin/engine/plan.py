"""A plan: what to wrap and how, as data. :func:`ckpt_plugin.engine.wrap.install` installs any plan.

Every mode becomes one (``full``, ``selective``, ``offload``, ``segments``,
``recursive`` and ``auto`` alike): the spine (``apply/plan.py``) or
the planner decides, the engine installs. A plan names modules by qualified
name, so it is checked against a model before anything is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_plugin.engine.segments.sequential import Node
from ckpt_plugin.engine.treatment import Treatment


@dataclass(frozen=True)
class EachLayer:
    """Every module named runs its own forward under ``treatment`` (one checkpoint per call).

    ``compile``: the ``torch.compile`` backend each call runs compiled with, checkpoint
    included (``ckpt.compile``, ``regional.py``); None: eager.
    """

    names: tuple[str, ...]
    treatment: Treatment
    compile: str | None = None


@dataclass(frozen=True)
class Segments:
    """The modules named form a chain cut into ``segments`` checkpointed regions (int, 'sqrt' or 'recursive'),
    or run under a planned schedule (``segments=optimal``: the nodes themselves, ``sequential.Region``s nesting)."""

    names: tuple[str, ...]
    segments: int | str | tuple[Node, ...]
    treatment: Treatment


Group = EachLayer | Segments


@dataclass(frozen=True)
class WrapPlan:
    """What :func:`~ckpt_plugin.engine.wrap.install` puts on a model; empty: nothing wrapped.

    ``summary`` is what is to be said when the plan is installed: ``note`` first, then
    ``ckpt=auto``'s table (and, when it wraps nothing, that the budget is why); ``note`` says what ``ckpt.layers=auto`` chose (``ckpt.layers=auto
    chose GPT2Block (HF GradientCheckpointingLayer): 12 modules``), "" otherwise, for reports that show
    it apart (``measure/report.py``); ``planned`` is the planner's own account of the plan
    (``ckpt=auto``'s ``Plan``: predicted peak and time), for the callback and tools that report
    it beside what the step then measures.
    """

    groups: tuple[Group, ...] = ()
    summary: str = ""
    planned: Any = None
    note: str = ""
    regroup: tuple[str, ...] = ()  # modules whose forward runs as op groups (``op_groups.py``): parts named in groups
    fit: Any = None  # ckpt.memory: the whole step predicted for the plan (``apply/memory.py``'s StepFit)

    @property
    def names(self) -> list[str]:
        """Every module the plan wraps, in plan order."""
        return [name for group in self.groups for name in group.names]


__all__ = ["EachLayer", "Group", "Segments", "WrapPlan"]

"""The whole step of one rank of a sharded strategy, measured on a fake twin the strategy itself shards.

Under FSDP (v1, and FSDP2's ``fully_shard``) a rank holds its shards of the parameters, gradients and optimizer
state, and, for a moment, each unit's gathered parameters and gradients
(reduce-scattered in backward); how many units are gathered at once depends on
the wrap policy, the sharding strategy and the prefetching. None of that is
modelled here: the strategy shards a twin of the module, and the twin's step is
measured as any step is (``measure/whole_step.py``).

    twin = make_twin(model, wrap, optimizers_of, rank=r, world_size=w)   # nothing allocated
    steps = TwinSteps(twin, twin_sample(twin, sample, run, step))        # an apply/memory.WholeSteps
    steps.of(plan, rows)                                                  # this rank's whole step, by category

The twin (:func:`make_twin`) is a copy of the module whose parameters and buffers
are fake tensors (``_compat/fsdp.py``'s ``fake_copy``) and whose other attributes
are the module's own; ``wrap`` shards it with torch's fake process group of the
run's size and this rank (FSDP2: a mesh of them), whose collectives move nothing
(the outputs FSDP allocated are all the memory a collective takes). A plan names the
module's layers as named before wrapping; :func:`renamed` takes it to the names the
wrapping gave the same modules (FSDP puts each unit's module inside it:
``blocks.0._fsdp_wrapped_module``; FSDP2 keeps the names). Under Lightning:
``lightning/fsdp.py``; without: ``ckpt_tools/fit_fsdp.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import (
    fake_copy,
    fake_process_group,
    fake_tensor_mode,
    fsdp_on_fake_tensors,
    shard_units,
    tree_map,
    user_module,
)
from ckpt_plugin.apply.batch import Sample
from ckpt_plugin.apply.memory import whole_of
from ckpt_plugin.engine.plan import EachLayer, Segments, WrapPlan
from ckpt_plugin.measure.whole_step import Held, StepSplit


@dataclass
class Twin:
    """A fake twin of a module, sharded by the strategy as the module will be (module docstring)."""

    module: nn.Module  # the twin of the module, inside ``wrapped``
    wrapped: nn.Module  # the strategy's root around it (FSDP's)
    optimizers: list[torch.optim.Optimizer]
    mode: Any  # the fake-tensor mode its tensors belong to
    names: dict[str, str]  # a module's name in the module (before wrapping) -> in the twin (after)
    device: torch.device | None = None  # where the strategy runs the module (FSDP moves it there)
    units: frozenset[str] = frozenset()  # the twin's modules gathered as units of their own (_compat.shard_units)

    def regions_allowed(self, names: list[str]) -> bool:
        """Whether none of the layers ``names`` is a unit of its own: only then can a region span several of them
        (``strategies.Measuring.chains``); it would recompute them when FSDP has resharded all but the last."""
        return not any(self.names.get(n, n) in self.units for n in names)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self.mode, fsdp_on_fake_tensors():
            yield


def make_twin(module: nn.Module, wrap: Callable[[nn.Module, Any], nn.Module],
              optimizers_of: Callable[[nn.Module], list[torch.optim.Optimizer]], *, rank: int, world_size: int,
              dtype: torch.dtype | None = None, device: torch.device | None = None) -> Twin:
    """The fake twin of ``module`` (whole), sharded by ``wrap(twin, process_group)`` as rank ``rank`` of
    ``world_size`` (a fake group), its optimizers ``optimizers_of(twin)`` built after wrapping; its floating
    tensors in ``dtype`` and all on ``device`` where given (``Module.to`` cannot swap a fake parameter in place)."""
    mode = fake_tensor_mode()
    twin, copies = fake_copy(module, mode, dtype, device)
    before = {id(m): n for n, m in user_module(module).named_modules()}
    with mode, fsdp_on_fake_tensors():
        wrapped = wrap(twin, fake_process_group(rank, world_size))
        optimizers = list(optimizers_of(twin))
    after = {id(m): n for n, m in user_module(twin).named_modules()}
    names = {before[i]: after[id(copy)] for i, copy in copies.items() if i in before and id(copy) in after}
    return Twin(twin, wrapped, optimizers, mode, names, device, shard_units(user_module(twin)))


@dataclass(frozen=True)
class TwinSteps:
    """``ckpt.memory``'s whole step on the twin (``apply/memory.WholeSteps``): ``sample`` is the twin's (its batch
    fake, its step the module's through the strategy's root: :func:`twin_sample`), the twin's
    optimizers stepping; ``held``: what the device holds beside it, the batch added."""

    twin: Twin
    sample: Sample
    held: tuple[Held, ...] = ()

    @property
    def device(self) -> torch.device | None:
        return self.twin.device

    def of(self, plan: WrapPlan, rows: int | None = None) -> StepSplit:
        with self.twin.active():
            return whole_of(self.twin.module, renamed(plan, self.twin.names), self.sample.loss(rows),
                            self.twin.optimizers, (*self.held, self.sample.held(rows)), fake=False)


def twin_sample(twin: Twin, sample: Sample, run: Callable[..., Any], step: Callable[[Any], Any] | None) -> Sample:
    """``sample`` for the twin: its call and batch as fake tensors of the twin's mode, ``run`` and ``step`` the
    twin's (``step`` None where the module's step is not measured: the call, summed)."""
    def to_twin(t: torch.Tensor) -> torch.Tensor:
        copy = twin.mode.from_tensor(t)
        # The module may run its sample where it is (the CPU, before FSDP moves it); the twin runs where the
        # strategy will: a fake copy moves there without memory.
        return copy if twin.device is None or copy.device == twin.device else copy.to(twin.device)

    def fake(value: Any) -> Any:
        return tree_map(lambda t: to_twin(t) if isinstance(t, torch.Tensor) else t, value)

    return Sample(fake(sample.call), run, fake(sample.batch), step if sample.step is not None else None)


def renamed(plan: WrapPlan, names: Mapping[str, str]) -> WrapPlan:
    """``plan`` with each module name (or op group under it) taken to ``names[name]``: the same modules, named
    after the strategy wrapped them; a name ``names`` lacks is kept."""

    def one(name: str) -> str:
        head, _, tail = name, "", ""
        while head and head not in names and "." in head:  # an op group's part: blocks.0.<group> under blocks.0
            head, _, last = head.rpartition(".")
            tail = f"{last}.{tail}" if tail else last
        if head in names:
            return ".".join(filter(None, [names[head], tail]))
        return name

    groups = tuple(replace(g, names=tuple(one(n) for n in g.names)) if isinstance(g, EachLayer | Segments) else g
                   for g in plan.groups)
    return replace(plan, groups=groups, regroup=tuple(one(n) for n in plan.regroup))


def names_after_wrapping(before: Mapping[str, nn.Module], model: nn.Module) -> dict[str, str]:
    """Each name of ``before`` (the modules by name before the strategy wrapped them) -> the name the same module
    has in ``model`` now."""
    now = {id(m): n for n, m in user_module(model).named_modules()}
    return {name: now[id(m)] for name, m in before.items() if id(m) in now}


__all__ = ["Twin", "TwinSteps", "make_twin", "names_after_wrapping", "renamed", "twin_sample"]

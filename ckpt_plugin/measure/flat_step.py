"""The optimizer's step as a DeepSpeed ZeRO rank runs it: on flat float32 partitions, measured on fake tensors
(issue #43).

DeepSpeed hands the user's optimizer, in place of the module's parameters, one flat float32 tensor per parameter
group: the rank's partition of the group's master copy, and steps one group at a time (0.19's ``_optimizer_step``:
ZeRO-1/2's ``stage_1_and_2.py`` leaves the optimizer that group alone, ZeRO-3's ``stage3.py`` sets the group's
``params`` to its sub-group's partition and empties them after). The optimizer's state and its step's temporaries
follow that layout, not the module's: torch's AdamW over one tensor holds two temporaries of its size at once
(``exp_avg_sq.sqrt()`` and its quotient), which on a flat partition is twice the partition in float32 and on the
module's parameters twice its largest one. A ZeRO-3 rank in bf16 measured 5.8 % above a prediction that scaled the
module's own step (hf.llama, docs/fit-a-gpu.md). So the step is measured as DeepSpeed runs it: the user's
optimizers, their hyperparameters and hooks, stepping fake partitions of those sizes, twice (the state made by the
first, the second tracked by MemTracker).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ckpt_plugin._compat import CategoryPeakTracker, fake_tensor_mode, storage_key
from ckpt_plugin.measure.whole_step import optimizers_over


@dataclass(frozen=True)
class Stepping:
    """What an optimizer's step holds on a rank's flat partitions, in bytes."""

    state: int  # its state between steps (moments, step counters)
    temporaries: int  # the most its step holds besides the state, the partitions and their gradients


def flat_stepping(optimizers: Sequence[torch.optim.Optimizer], partitions: Sequence[Sequence[int]],
                  device: torch.device) -> Stepping:
    """The step of ``optimizers`` over flat float32 partitions on ``device``, one group at a time (the others'
    ``params`` empty): ``partitions[i][j]`` elements for optimizer ``i``'s group ``j`` (0: none here)."""
    with fake_tensor_mode():
        flats = [[torch.zeros(n, device=device, requires_grad=True) if n else None for n in groups]
                 for groups in partitions]
        for flat in _present(flats):
            flat.grad = torch.zeros_like(flat)
        with optimizers_over(optimizers, lambda i, j, _params: [flats[i][j]] if flats[i][j] is not None else []):
            _steps(optimizers, flats)  # the state, as the first step makes it
            state = sum(_storages(o.state for o in optimizers).values())
            tracker = CategoryPeakTracker()
            tracker.track_external(*_present(flats), *(f.grad for f in _present(flats)), *optimizers)
            with tracker:
                before = _total(tracker.get_tracker_snapshot())
                _steps(optimizers, flats)
                peak = _total(tracker.get_tracker_snapshot("peak"))
    return Stepping(state=state, temporaries=max(peak - before, 0))


def _steps(optimizers: Sequence[torch.optim.Optimizer], flats: list[list[torch.Tensor | None]]) -> None:
    for optimizer, groups in zip(optimizers, flats, strict=True):
        for alone, flat in enumerate(groups):
            if flat is None:
                continue
            for j, group in enumerate(optimizer.param_groups):
                group["params"] = [flat] if j == alone else []
            optimizer.step()
        for group, flat in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = [flat] if flat is not None else []


def _present(flats: list[list[torch.Tensor | None]]) -> list[torch.Tensor]:
    return [f for groups in flats for f in groups if f is not None]


def _storages(states: Iterator[dict]) -> dict[tuple[str, int], int]:
    """Bytes of each storage the optimizers' state holds, by the storage (a tensor shared by two entries once)."""
    held: dict[tuple[str, int], int] = {}
    for state in states:
        for entry in state.values():
            for value in entry.values() if isinstance(entry, dict) else ():
                if isinstance(value, torch.Tensor):
                    held[storage_key(value)] = value.untyped_storage().nbytes()
    return held


def _total(snapshot: dict) -> int:
    return sum(s.get("Total", 0) for s in snapshot.values())


__all__ = ["Stepping", "flat_stepping"]

"""The optimizer's step on a ZeRO rank's flat float32 partitions (``measure/flat_step.py``): measured on fake
tensors, equal to the same step on real tensors to the byte; the partitions as DeepSpeed cuts them
(``apply/zero.py``); the optimizer left as it was."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from ckpt_plugin._compat import CategoryPeakTracker
from ckpt_plugin.apply.zero import Zero, Zero3, rank_steps
from ckpt_plugin.measure.flat_step import Stepping, flat_stepping


def _real(optimizer: torch.optim.Optimizer, partitions: list[int]) -> Stepping:
    """The same step on real flat tensors, one group at a time, as DeepSpeed runs it: the state after the first,
    MemTracker's peak over the second less what it started with."""
    flats = [torch.zeros(n, requires_grad=True) for n in partitions]
    optimizer.state = defaultdict(dict)  # Adagrad's __init__ made state for the module's parameters
    for flat in flats:
        flat.grad = torch.ones_like(flat)
    for group, flat in zip(optimizer.param_groups, flats, strict=True):
        group["params"] = [flat]

    def steps() -> None:
        for alone, flat in enumerate(flats):
            for j, group in enumerate(optimizer.param_groups):
                group["params"] = [flat] if j == alone else []
            optimizer.step()

    steps()
    state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    tracker = CategoryPeakTracker()
    tracker.track_external(*flats, *(f.grad for f in flats), optimizer)
    with tracker:
        before = sum(s.get("Total", 0) for s in tracker.get_tracker_snapshot().values())
        steps()
        peak = sum(s.get("Total", 0) for s in tracker.get_tracker_snapshot("peak").values())
    return Stepping(state=state, temporaries=peak - before)


def _two_groups(make):
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20))
    return make([{"params": model[0].parameters()}, {"params": model[1].parameters(), "weight_decay": 0.0}])


@pytest.mark.parametrize("make", [
    lambda groups: torch.optim.AdamW(groups, lr=1e-3),
    lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda groups: torch.optim.SGD(groups, lr=0.1),
    lambda groups: torch.optim.Adagrad(groups, lr=0.1),
], ids=["adamw", "sgd-momentum", "sgd", "adagrad"])
def test_the_fake_step_on_flat_partitions_is_the_real_one_to_the_byte(make) -> None:
    partitions = [1_000, 3_000]
    fake = flat_stepping([_two_groups(make)], [partitions], torch.device("cpu"))
    assert fake == _real(_two_groups(make), partitions)


def test_adamw_holds_two_moments_and_a_step_counter_per_group_and_its_step_two_temporaries_of_a_partition() -> None:
    """What the per-parameter measurement missed on a ZeRO rank (hf.llama, ZeRO-3 in bf16, 5.8 % above): torch's
    AdamW over one flat tensor holds ``sqrt`` of its second moment and the quotient at once, each the size of the
    partition, where over the module's parameters each was the size of its largest."""
    optimizer = _two_groups(lambda groups: torch.optim.AdamW(groups, lr=1e-3))
    params = [g["params"] for g in optimizer.param_groups]
    stepping = flat_stepping([optimizer], [[1_000, 3_000]], torch.device("cpu"))
    assert stepping.state == 2 * (1_000 + 3_000) * 4 + 2 * 4
    assert stepping.temporaries == 2 * 3_000 * 4
    assert [g["params"] for g in optimizer.param_groups] == params and not optimizer.state  # left as it was


def test_the_partitions_are_cut_as_deepspeed_cuts_them() -> None:
    """SGD with momentum: one float32 buffer the size of the rank's partition. ZeRO-1/2 split each group's flat
    buffer over the world (ceil(1,230 / 4) + ceil(620 / 4)); ZeRO-3 each parameter (ceil of each of four);
    a group of frozen parameters has no partition."""
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20), nn.Linear(20, 2))
    model[2].requires_grad_(False)
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()},
                                 {"params": model[2].parameters()}], lr=0.1, momentum=0.9)
    x = torch.randn(2, 40)

    def steps(zero):
        return rank_steps(model, lambda rows: lambda: model(x).sum(), [optimizer], lambda rows: (), zero)

    assert steps(Zero(stage=2, world=4, reduce_bucket_size=1_000, overlap_comm=True)).stepping.state == \
        (308 + 155) * 4
    three = steps(Zero3(world=4, reduce_bucket_size=1_000)).stepping
    assert three.state == (300 + 8 + 150 + 5) * 4 and three.temporaries == 0

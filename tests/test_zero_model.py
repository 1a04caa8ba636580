"""A DeepSpeed ZeRO-1/2 rank's whole step as ``apply/zero.py`` models it from the module's own, term by term, and
what the strategy's config leaves unmodelled refused by name (``lightning/zero.py``). The model against real
ranks: tests/test_auto_sharded.py (2 gloo processes, every rank measured)."""

from __future__ import annotations

import pytest

from ckpt_plugin.apply.zero import Zero, rank_step
from ckpt_plugin.measure.whole_step import Held, StepSplit

# The module's step (one process, fake tensors) as whole_step measures it: its parameters 1,000 B, the optimizer's
# state 2,000 B; without its gradients backward held at most 5,000 B of activations and 300 B of temporaries, and
# 8,000 B once 400 B of gradients had been made; the optimizer's step 200 B of temporaries of its own.
MODULE = StepSplit(
    peak=9_999, at_peak={"parameter": 1_000, "gradient": 1_000, "optstate": 2_000, "activation": 5_000},
    gradless={"parameter": 1_000, "gradient": 0, "optstate": 2_000, "activation": 5_000, "temp": 300, "total": 8_300},
    in_optimizer={"parameter": 1_000, "gradient": 1_000, "optstate": 2_200, "total": 4_200},
    gradless_at={0: 8_300, 400: 8_000, 1_000: 3_100}, held=(Held(64, "the batch"),))


def test_a_rank_holds_its_partitions_the_buffers_and_the_module_s_activations_without_its_gradients() -> None:
    """250 elements in one group, 2 ranks, buckets of 1,000 elements (all the gradients fit one: no partition is
    reduced before backward ends), overlap_comm: two buffers."""
    zero = Zero(stage=2, world=2, reduce_bucket_size=1_000, overlap_comm=True)
    step = rank_step(MODULE, zero, groups=[250], largest=50)
    partition = 125 * 4
    persistent = 1_000 + 2 * partition + partition + 2_000 // 2  # parameters, 2 gradient partitions, master + state
    backward = persistent + 5_000 + 300 + 50 * 4  # the module's backward without its gradients, one in hand
    assert step.peak == backward + 64 + 2 * 1_000 * 4
    assert [h.bytes for h in step.held] == [64, 8_000]
    assert step.held[1].by == "DeepSpeed's reduce buffers (2 x reduce_bucket_size=1000 elements)"


def test_with_more_gradients_than_a_bucket_a_partition_is_reduced_while_activations_live() -> None:
    """Buckets of 100 elements (400 B): once 400 B of gradients were made, the module held 8,000 B besides them;
    grads_in_partition (the partition and the largest parameter) is made then on one rank."""
    zero = Zero(stage=1, world=2, reduce_bucket_size=100, overlap_comm=False)
    step = rank_step(MODULE, zero, groups=[250], largest=50)
    partition = 125 * 4
    persistent = 1_000 + 2 * partition + partition + 1_000
    late = 8_000 - 1_000 - 2_000  # what else the module's backward held then
    assert step.peak == persistent + late + (partition + 50 * 4) + 50 * 4 + 64 + 100 * 4


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"stage": 2, "offload_optimizer": True}, "offload to host memory is not modelled yet "
                                              "(zero_optimization.offload_optimizer)"),
    ({"stage": 2, "contiguous_gradients": False}, "with contiguous_gradients=false the gradients stay whole until "
                                                  "their bucket is reduced: not modelled yet "
                                                  "(zero_optimization.contiguous_gradients)"),
    ({"stage": 3}, "ZeRO stage 3's rank step is not modelled yet"),
])
def test_what_the_config_leaves_unmodelled_is_refused_naming_its_key(kwargs, said) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from cpu_strategies import CPUDeepSpeedStrategy

    from ckpt_plugin.lightning.zero import zero_refused

    err = zero_refused(CPUDeepSpeedStrategy(**kwargs), "ckpt.memory", "1GiB")
    assert err is not None
    (problem,) = err.problems
    assert problem.key == "ckpt.memory"
    assert problem.problem.startswith(
        f"ckpt.memory=1GiB cannot be planned under trainer.strategy CPUDeepSpeedStrategy (ZeRO stage "
        f"{kwargs['stage']}): {said}"), problem.problem
    assert zero_refused(CPUDeepSpeedStrategy(stage=2), "ckpt.memory", "1GiB") is None

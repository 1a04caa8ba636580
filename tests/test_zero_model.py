"""A DeepSpeed ZeRO rank's whole step as ``apply/zero.py`` models it from the module's own, term by term (ZeRO-3's
gathering played on the fake step: ``apply/zero3_gather.py``, to the byte), and what the strategy's config leaves
unmodelled refused by name (``lightning/zero.py``). The model against real
ranks: tests/test_auto_sharded.py (2 gloo processes, every rank measured)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckpt_plugin.apply.zero import Stepping, Zero, Zero3, rank_step, rank_step3
from ckpt_plugin.measure.whole_step import Held, StepSplit

# The module's step (one process, fake tensors) as whole_step measures it: its parameters 1,000 B, the optimizer's
# state 2,000 B; without its gradients backward held at most 5,000 B of activations and 300 B of temporaries, and
# 8,000 B once 400 B of gradients had been made; the optimizer's step 200 B of temporaries of its own.
MODULE = StepSplit(
    peak=9_999, at_peak={"parameter": 1_000, "gradient": 1_000, "optstate": 2_000, "activation": 5_000},
    gradless={"parameter": 1_000, "gradient": 0, "optstate": 2_000, "activation": 5_000, "temp": 300, "total": 8_300},
    in_optimizer={"parameter": 1_000, "gradient": 1_000, "optstate": 2_200, "total": 4_200},
    gradless_at={0: 8_300, 400: 8_000, 1_000: 3_100}, held=(Held(64, "the batch"),))
# The optimizer's step on the rank's flat partition (2 ranks): its state 1,000 B, 100 B of temporaries.
STEPPING = Stepping(state=1_000, temporaries=100)


def test_a_rank_holds_its_partitions_the_buffers_and_the_module_s_activations_without_its_gradients() -> None:
    """250 elements in one group, 2 ranks, buckets of 1,000 elements (all the gradients fit one: no partition is
    reduced before backward ends), overlap_comm: two buffers."""
    zero = Zero(stage=2, world=2, reduce_bucket_size=1_000, overlap_comm=True)
    step = rank_step(MODULE, zero, groups=[250], stepping=STEPPING, largest=50)
    partition = 125 * 4
    persistent = 1_000 + partition + 2_000 // 2  # parameters, master copy + state (no gradient outlives a step)
    backward = persistent + 5_000 + 300 + 50 * 4  # the module's backward without its gradients, one in hand
    assert step.peak == backward + 64 + 2 * 1_000 * 4
    assert [h.bytes for h in step.held] == [64, 8_000]
    assert step.held[1].by == "DeepSpeed's reduce buffers (2 x reduce_bucket_size=1000 elements)"


def test_with_more_gradients_than_a_bucket_a_partition_is_reduced_while_activations_live() -> None:
    """Buckets of 100 elements (400 B): once 400 B of gradients were made, the module held 8,000 B besides them;
    grads_in_partition (the partition and the largest parameter) is made then on one rank."""
    zero = Zero(stage=1, world=2, reduce_bucket_size=100, overlap_comm=False)
    step = rank_step(MODULE, zero, groups=[250], stepping=STEPPING, largest=50)
    partition = 125 * 4
    persistent = 1_000 + partition + 1_000
    late = 8_000 - 1_000 - 2_000  # what else the module's backward held then
    assert step.peak == persistent + late + (partition + 50 * 4) + 50 * 4 + 64 + 100 * 4


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"stage": 2, "offload_optimizer": True}, "offload under ZeRO stage 2 is not modelled yet (under ZeRO-3 it is) "
                                              "(zero_optimization.offload_optimizer)"),
    ({"stage": 2, "contiguous_gradients": False}, "with contiguous_gradients=false the gradients stay whole until "
                                                  "their bucket is reduced: not modelled yet "
                                                  "(zero_optimization.contiguous_gradients)"),
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


@pytest.mark.parametrize(("precision", "config", "said"), [
    ("16-mixed", {}, "with precision 16-mixed the step is not modelled yet (32-bit and bf16 are) (trainer.precision)"),
    ("bf16-mixed", {"data_types": {"grad_accum_dtype": "fp32"}},
     "gradients accumulated or communicated in another dtype than the module's: not modelled yet "
     "(data_types.grad_accum_dtype)"),
])
def test_fp16_and_another_gradient_dtype_are_refused_naming_the_key_and_bf16_is_planned(precision, config,
                                                                                        said) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from cpu_strategies import CPUDeepSpeedStrategy
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    from ckpt_plugin.lightning.zero import zero_refused

    strategy = CPUDeepSpeedStrategy(stage=3)
    strategy.precision_plugin = DeepSpeedPrecision(precision)
    strategy.config.update(config)
    (problem,) = zero_refused(strategy, "ckpt.memory", "1GiB").problems
    assert problem.problem.startswith("ckpt.memory=1GiB cannot be planned under trainer.strategy "
                                      f"CPUDeepSpeedStrategy (ZeRO stage 3): {said}"), problem.problem
    planned = CPUDeepSpeedStrategy(stage=2)
    planned.precision_plugin = DeepSpeedPrecision("bf16-mixed")
    assert zero_refused(planned, "ckpt.memory", "1GiB") is None


@pytest.mark.parametrize(("kwargs", "ratio", "said"), [
    ({"offload_parameters": True, "offload_params_device": "nvme", "nvme_path": "/local_nvme"}, 1.0,
     "offload to nvme is not modelled yet (to cpu it is) (zero_optimization.offload_param.device)"),
    ({"offload_optimizer": True}, 0.5, "offloading part of the optimizer is not modelled yet (all of it is: ratio "
                                       "1.0) (zero_optimization.offload_optimizer.ratio)"),
])
def test_zero_3_offload_to_cpu_is_planned_and_to_nvme_or_in_part_is_refused_naming_its_key(kwargs, ratio, said) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from cpu_strategies import CPUDeepSpeedStrategy

    from ckpt_plugin.lightning.zero import deepspeed_linear, zero_refused

    strategy = CPUDeepSpeedStrategy(stage=3, **kwargs)
    if ratio != 1.0:
        strategy.config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    (problem,) = zero_refused(strategy, "ckpt.batch", "max").problems
    assert problem.problem.startswith("ckpt.batch=max cannot be planned under trainer.strategy CPUDeepSpeedStrategy "
                                      f"(ZeRO stage 3): {said}"), problem.problem
    # Lightning's deepspeed_stage_3_offload (both to cpu) is planned, as ZeRO-3 without offload
    offload = CPUDeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    assert zero_refused(offload, "ckpt.memory", "1GiB") is None
    assert zero_refused(CPUDeepSpeedStrategy(stage=3), "ckpt.memory", "1GiB") is None
    assert deepspeed_linear(CPUDeepSpeedStrategy(stage=3)) and not deepspeed_linear(CPUDeepSpeedStrategy(stage=2))


def test_a_zero_3_rank_holds_its_partitions_a_master_copy_its_gradients_partitions_and_one_reduce_buffer() -> None:
    """The module's step with ZeRO-3's gathering played on it: its parameters 1,000 B whole, of which 800 B are
    partitioned (the rest kept whole), the gathered ones counted among its parameters (here 600 B at backward's
    peak); 250 elements, 2 ranks: partitions of 125 elements."""
    module = StepSplit(
        peak=9_999, at_peak={"parameter": 1_600, "gradient": 1_000, "optstate": 2_000, "activation": 5_000},
        gradless={"parameter": 1_600, "gradient": 400, "optstate": 2_000, "activation": 5_000, "temp": 300},
        in_optimizer={"parameter": 1_000, "gradient": 1_000, "optstate": 2_200}, held=(Held(64, "the batch"),))
    zero = Zero3(world=2, reduce_bucket_size=1_000)
    step = rank_step3(module, zero, partitions=125, trained=125, whole=800, stepping=STEPPING, largest=50)
    own = 125 * 4  # the parameters' partitions; as much again: the float32 master copy; and the gradients'
    backward = (1_600 - 800 + own + own) + own + 2_000 // 2 + 5_000 + 300 + 50 * 4
    assert step.peak == backward + 64 + 1_000 * 4
    assert step.at_peak["parameter"] == 1_600 - 800 + 2 * own and step.at_peak["gradient"] == own
    assert [h.by for h in step.held] == ["the batch", "DeepSpeed's reduce buffer (reduce_bucket_size=1000 elements)"]
    # The optimizer's step ends gathering the parameters kept whole again (here 10,000 B of buffer and copies):
    # its parameters then, its partitions and state, the gradients' partitions, above backward's peak.
    ended = rank_step3(module, zero, partitions=125, trained=125, whole=800, stepping=STEPPING, largest=50,
                       regather=10_000)
    assert ended.peak == (1_000 + (own + own - 800) + 10_000) + own + 2_000 // 2 + 64 + 1_000 * 4
    # Backward's epilogue: the last bucket's gradients flattened and the reduce-scatter's buffer (every gradient
    # here: 250 elements), one gradient in hand; above the rest where backward holds few activations.
    light = StepSplit(peak=0, gradless={"parameter": 1_600, "activation": 100}, in_optimizer=module.in_optimizer,
                      held=module.held)
    step = rank_step3(light, zero, partitions=125, trained=125, whole=800, stepping=STEPPING, largest=50)
    assert step.peak == (1_000 + 2 * own - 800) + own + STEPPING.state + 2 * 250 * 4 + 50 * 4 + 64 + 1_000 * 4


def test_zero_3_offload_leaves_the_device_s_step_on_a_gpu_and_stays_in_it_where_the_host_is_the_device() -> None:
    """The same module under Lightning's deepspeed_stage_3_offload (optimizer and parameters to cpu): the
    partitions (500 B), the master copy (500 B), the gradients' partitions and the master copy's own float32
    gradient (500 B each, both kept), the optimizer's state on the partition (1,000 B) are in host memory."""
    module = StepSplit(
        peak=9_999, at_peak={"parameter": 1_600, "gradient": 1_000, "optstate": 2_000, "activation": 5_000},
        gradless={"parameter": 1_600, "gradient": 400, "optstate": 2_000, "activation": 5_000, "temp": 300},
        in_optimizer={"parameter": 1_000, "gradient": 1_000, "optstate": 2_200}, held=(Held(64, "the batch"),))
    terms = {"partitions": 125, "trained": 125, "whole": 800, "stepping": STEPPING, "largest": 50}
    on_gpu = rank_step3(module, Zero3(world=2, reduce_bucket_size=1_000, offload_optimizer=True,
                                      offload_param=True), **terms)
    # backward: the gathered parameters (1,600 B less the 800 B whole), activations, temporaries, one gradient
    assert on_gpu.peak == (1_600 - 800) + 5_000 + 300 + 50 * 4 + 64 + 1_000 * 4
    assert on_gpu.at_peak["gradient"] == on_gpu.at_peak["optstate"] == 0
    assert on_gpu.offloaded == Held(500 + 500 + 2 * 500 + 1_000, "offloaded to host memory (not on the device: not "
                                                                  "counted)")
    on_cpu = rank_step3(module, Zero3(world=2, reduce_bucket_size=1_000, offload_optimizer=True, offload_param=True,
                                      host_is_device=True), **terms)
    assert on_cpu.peak == on_gpu.peak + 3_000 and on_cpu.at_peak["gradient"] == 2 * 500
    assert on_cpu.offloaded is not None and on_cpu.offloaded.by.endswith("(the device here: counted above)")
    # against ZeRO-3 without offload on the same device: one more gradient partition (the master copy's, kept)
    kept = rank_step3(module, Zero3(world=2, reduce_bucket_size=1_000), **terms)
    assert on_cpu.peak == kept.peak + 500 and kept.offloaded is None
    assert str(on_gpu).endswith("; offloaded to host memory (not on the device: not counted) 2.9 KiB")


def _gathered_peak(redirected: bool) -> int:
    """The parameters' peak of a two-layer module's fake step with ZeRO-3's gathering played on it: 2 ranks,
    nothing kept whole, every prefetch and reuse allowed."""
    import torch
    from torch import nn

    from ckpt_plugin.apply.zero import rank_steps
    from ckpt_plugin.engine.plan import WrapPlan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20, bias=False), nn.ReLU(), nn.Linear(20, 10, bias=False))
    x = torch.randn(3, 10)
    zero = Zero3(world=2, reduce_bucket_size=1_000, prefetch_bucket_size=10**9, param_persistence_threshold=0)
    steps = rank_steps(model, lambda rows: lambda: model(x).sum(), [torch.optim.SGD(model.parameters(), lr=0.1)],
                       lambda rows: (), zero, redirected=redirected)
    return steps.steps.of(WrapPlan()).peaks["param"]


def test_zero_3_gathers_as_deepspeed_prefetching_once_its_trace_is_complete() -> None:
    """Called as an engine calls it (its step a call of the module): the second step's trace is complete, so the
    first fetch prefetches both weights into one flat buffer (100 elements of each rank's, 2 ranks: 400 elements),
    copied out whole when the first is waited for (200 + 200); the buffer lives until the second is fetched.
    Besides, the step's own whole weights: 1,600 B."""
    assert _gathered_peak(redirected=False) == 1_600 + 400 * 4 + 400 * 4


def test_zero_3_under_lightning_gathers_each_layer_alone() -> None:
    """As Lightning runs a step under DeepSpeed (training_step as a call of the module, which calls the module
    again), DeepSpeed resets its trace twice a step and never completes it: no prefetch, each weight gathered
    alone (a buffer of its own, 200 elements) when its layer runs and released after."""
    assert _gathered_peak(redirected=True) == 1_600 + 200 * 4


def test_deepspeed_s_host_adam_is_measured_as_torch_s_adam_of_the_same_state() -> None:
    """Under offload DeepSpeed asks for its own CPU Adam, whose step is an op of its own that fake tensors cannot
    run: the whole step is measured with torch's Adam over the same groups, whose state is the same two float32
    moments a parameter (and its step count as a 4 B tensor, where CPU Adam keeps an int: an upper bound)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from ckpt_plugin.lightning.zero import stand_in

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters()), "lr": 0.1}]
    host = DeepSpeedCPUAdam.__new__(DeepSpeedCPUAdam)  # the class as users build it, less its op (a C++ build)
    torch.optim.Optimizer.__init__(host, groups, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                                                      bias_correction=True, amsgrad=False))
    measured = stand_in(host)
    assert type(measured) is torch.optim.Adam
    assert [g["params"] for g in measured.param_groups] == [g["params"] for g in host.param_groups]
    model(torch.ones(3, 8)).sum().backward()
    measured.step()
    state = sum(t.numel() * t.element_size() for s in measured.state.values() for t in s.values())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert state == 2 * params + 4 * len(list(model.parameters()))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert stand_in(sgd) is sgd


def test_in_bf16_the_module_s_terms_are_two_bytes_an_element_and_the_master_copy_and_state_four() -> None:
    """The module's step measured with its parameters in bf16 (as DeepSpeed casts them): its partitions, gradients,
    the reduce buffers and the gradient in hand in bf16; the master copy and the optimizer's state on it float32
    (measured on the flat partition: ``STEPPING``); in the step the gradients flattened in bf16, then in float32."""
    import torch

    module = StepSplit(
        peak=9_999, at_peak={"parameter": 1_600, "gradient": 1_000, "optstate": 2_000, "activation": 5_000},
        gradless={"parameter": 1_600, "gradient": 400, "optstate": 2_000, "activation": 5_000, "temp": 300},
        in_optimizer={"parameter": 1_000, "gradient": 1_000, "optstate": 2_200}, held=(Held(64, "the batch"),))
    zero3 = Zero3(world=2, reduce_bucket_size=1_000, dtype=torch.bfloat16)
    step = rank_step3(module, zero3, partitions=125, trained=125, whole=800, stepping=STEPPING, largest=50)
    own, master, grads = 125 * 2, 125 * 4, 125 * 2
    backward = (1_600 - 800 + own + master) + grads + STEPPING.state + 5_000 + 300 + 50 * 2
    assert step.peak == backward + 64 + 1_000 * 2
    assert step.held[-1] == Held(2_000, "DeepSpeed's reduce buffer (reduce_bucket_size=1000 elements)")
    zero2 = Zero(stage=2, world=2, reduce_bucket_size=1_000, overlap_comm=True, dtype=torch.bfloat16)
    step = rank_step(MODULE, zero2, groups=[250], stepping=STEPPING, largest=50)
    persistent = 1_000 + 125 * 4 + STEPPING.state  # the module's parameters (bf16, measured), master, state
    assert step.peak == persistent + 5_000 + 300 + 50 * 2 + 64 + 2 * 1_000 * 2


def test_cast_puts_the_parameters_in_bf16_as_deepspeed_does_and_leaves_the_buffers() -> None:
    """DeepSpeed 0.19 casts the parameters only (``_cast_module_mixed_precision``); in place, so an optimizer over
    them keeps its state in bf16 inside; put back after."""
    import torch

    from ckpt_plugin.apply.zero import cast

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    weight = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with cast(model, torch.bfloat16):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model[0].weight is weight
        assert model[1].running_mean.dtype == torch.float32
        model[0](torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
        optimizer.step()
        assert optimizer.state[weight]["momentum_buffer"].dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32} and model[0].weight is weight


def test_a_zero_3_bucket_reduced_while_a_recomputed_block_s_activations_live_is_a_moment_of_its_own() -> None:
    """Buckets of 100 elements (400 B): the gradients arrive 400 B, then 600 B; DeepSpeed flushes the first 400 B
    before the second goes in, flattened with the reduce-scatter's buffer beside (800 B), while the module's
    backward held 8,300 B besides its gradients (under Lightning with a block recomputed whole, the moment above
    the rest: the rank's step measured 2.9 % above a prediction without it)."""
    module = StepSplit(
        peak=9_999, at_peak={"parameter": 1_600, "gradient": 1_000, "optstate": 2_000, "activation": 5_000},
        gradless={"parameter": 1_600, "gradient": 400, "optstate": 2_000, "activation": 5_000, "temp": 300},
        in_optimizer={"parameter": 1_000, "gradient": 1_000, "optstate": 2_200}, held=(Held(64, "the batch"),),
        gradless_at={0: 8_000, 400: 8_000, 1_000: 8_300})
    step = rank_step3(module, Zero3(world=2, reduce_bucket_size=100), partitions=125, trained=125, whole=800,
                      stepping=STEPPING, largest=50)
    own = 125 * 4
    rank = (own + own - 800) + own + 2_000 // 2  # partitions, master copy, less the whole; gradients; state
    assert step.peak == rank + (8_300 - 2_000 + 2 * 400) + 50 * 4 + 64 + 100 * 4
    quiet = rank_step3(replace(module, gradless_at={0: 8_000, 400: 8_000, 1_000: 7_000}),
                       Zero3(world=2, reduce_bucket_size=100), partitions=125, trained=125, whole=800,
                       stepping=STEPPING, largest=50)
    backward = (1_600 - 800 + own + own) + own + 2_000 // 2 + 5_000 + 300 + 50 * 4
    assert quiet.peak == backward + 64 + 100 * 4


def test_zero_1_2_s_reduce_buffers_are_not_in_the_optimizer_s_step() -> None:
    """DeepSpeed makes the reduce buffers at backward's start and frees them at its end (``setup_buckets``,
    ``_release_ipg_buffers``); grads_in_partition's views go before the optimizer steps. An optimizer whose step
    holds 20,000 B of temporaries on the partition: the step leads, without the buffers and grads_in_partition."""
    zero = Zero(stage=2, world=2, reduce_bucket_size=1_000, overlap_comm=True)
    step = rank_step(MODULE, zero, groups=[250], stepping=Stepping(state=1_000, temporaries=20_000), largest=50)
    partition = 125 * 4
    persistent = 1_000 + partition + 1_000  # parameters, master copy, state
    assert step.peak == persistent + 20_000 + partition + 64  # + the float32 gradient, the batch
    assert [h.by for h in step.held] == ["the batch"]

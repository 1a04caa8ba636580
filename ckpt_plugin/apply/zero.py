"""One DeepSpeed ZeRO rank's whole step, from the module's own step measured on fake tensors (issue #43): ZeRO-1/2
here (:func:`rank_step`), ZeRO-3 from the same step with DeepSpeed's gathering played on it (:func:`rank_step3`,
``apply/zero3_gather.py``).

DeepSpeed's engine cannot be built on fake tensors, so its step is not measured: it is modelled, term by term,
from what the module's step (``measure/whole_step.py``, one process, as under DDP) measured and what the
DeepSpeed config says. What a rank holds (DeepSpeed 0.19, ``runtime/zero/stage_1_and_2.py``; the
parameters, the gradients and the optimizer's state in float32):

- the parameters, whole on every rank: views of one flat buffer per parameter group (measured);
- its partition of each group (``ceil(numel / world)`` elements): a float32 master copy the optimizer steps
  (modelled); no gradient outlives a step (the master copy's float32 one is freed after it);
- the optimizer's state on its partition: measured on fake flat partitions as DeepSpeed steps them
  (``measure/flat_step.py``: one group at a time), with its step's temporaries;
- while backward runs (from its start to its end, not in the optimizer's step), the reduce buffer
  (``contiguous_gradients``): ``reduce_bucket_size`` elements of the gradients' dtype, two with ``overlap_comm``
  (modelled from the config); each gradient is copied into it as
  backward makes it, so the gradients never all live at once: backward's peak is the module's less its
  gradients (``StepSplit.gradless``, measured), one gradient in hand;
- ``grads_in_partition`` (the partition and the parameter on its edge), made each step at the first bucket of
  the rank's partition: mid-backward where the gradients outgrow a bucket (``StepSplit.gradless_after``);
- backward's epilogue: the last bucket flattened, which the collective may hold past the next allocation;
- in the optimizer's step, grads_in_partition flattened into the master copy's float32 gradient (a copy), and
  the optimizer's temporaries on the partition (measured).

The largest of those moments is the larger rank's step, an upper bound of each. Checked against DeepSpeed
engines on 2 gloo ranks (``python -m ckpt_tools.fit_fsdp --batch --strategy deepspeed_stage_2,deepspeed_stage_1``,
seven models, AdamW and SGD, three limits): every rank under its limit (84 of 84), within 5 % of the larger
rank's in 76 of 84, up to 7.6 % on hf.llama (docs/fit-a-gpu.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckpt_plugin.apply.memory import ModuleSteps
from ckpt_plugin.apply.zero3_gather import Zero3, gathering, persistent
from ckpt_plugin.measure.flat_step import Stepping, flat_stepping
from ckpt_plugin.measure.whole_step import Held, StepSplit
from ckpt_plugin.engine.plan import WrapPlan

FLOAT32 = 4  # bytes: the master copy, its gradient, the optimizer's state


@dataclass(frozen=True)
class Zero:
    """What a ZeRO-1/2 rank's step depends on, from the DeepSpeed config (``lightning/zero.py`` reads it)."""

    stage: int
    world: int
    reduce_bucket_size: int  # elements
    overlap_comm: bool
    dtype: torch.dtype = torch.float32  # the module's, as DeepSpeed casts it (bf16/fp16): its gradients' too

    @property
    def grad_bytes(self) -> int:
        """The gradients' element size: the module's dtype (the reduce buffers', ``grads_in_partition``'s)."""
        return self.dtype.itemsize

    @property
    def buffers(self) -> Held:
        count = 2 if self.overlap_comm else 1
        return Held(self.reduce_bucket_size * self.grad_bytes * count,
                    f"DeepSpeed's reduce buffer{'s' if count > 1 else ''} ({count} x reduce_bucket_size="
                    f"{self.reduce_bucket_size:g} elements)")

    def partitions(self, groups: Sequence[int]) -> int:
        """Elements of this rank's partition: each parameter group's flat buffer split over the world."""
        return sum(math.ceil(numel / self.world) for numel in groups)


@contextlib.contextmanager
def cast(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``model``'s floating parameters in ``dtype``, as DeepSpeed casts the module under bf16 or fp16 (0.19's
    ``_cast_module_mixed_precision``: the parameters, not the buffers): in place (an optimizer steps the same
    objects: its state in that dtype too); put back after. Here on the fake step's copies
    (``apply/memory.ModuleSteps.around``)."""
    kept = [(t, t.data) for t in model.parameters() if t.is_floating_point() and t.dtype != dtype]
    for t, data in kept:
        t.data = data.to(dtype)
    try:
        yield
    finally:
        for t, data in kept:
            t.data = data


def rank_step(split: StepSplit, zero: Zero, groups: Sequence[int], stepping: Stepping,
              largest: int = 0) -> StepSplit:
    """A ZeRO-1/2 rank's whole step, from ``split`` (the module's step on fake tensors, its optimizers stepping
    the whole module, its held bytes: the batch), ``groups`` (elements of each parameter group trained),
    ``stepping`` (the optimizer's state and temporaries on the rank's flat partitions) and ``largest`` (the
    elements of the largest parameter trained). The larger rank's: an upper bound of each."""
    back, opt = split.gradless, split.in_optimizer
    state = back.get("optstate", 0)  # the module's optimizer state alive through its forward and backward
    elements = zero.partitions(groups)
    partition = elements * FLOAT32  # the float32 master copy
    # No gradient outlives the step: the float32 one the optimizer steps is freed after it, grads_in_partition
    # (below) with it (``_release_ipg_buffers`` drops it at backward's end; its views live until the step).
    persistent = {"parameter": back.get("parameter", 0) + back.get("buffer", 0), "gradient": 0,
                  "optstate": partition + stepping.state}
    # grads_in_partition, made again each step at the first bucket of this rank's partition that backward
    # reduces, and kept through the optimizer's step: the partition and the parameter that straddles its edge.
    # With more gradients than one bucket holds, that is mid-backward on the rank whose partition holds the last
    # layers (activations still alive); with one bucket, at backward's end on every rank.
    reduced = (elements + largest) * zero.grad_bytes
    # Backward copies each gradient into the reduce buffer as it is made: one (up to the largest) is in hand
    # besides the buffer.
    in_hand = largest * zero.grad_bytes
    backward = {**persistent, "activation": back.get("activation", 0), "temp": back.get("temp", 0) + in_hand,
                "other": back.get("other", 0)}
    # What the module's backward held besides its gradients once a bucket's worth of them was made (0 when they
    # fit one bucket: reduced at the end), less what the rank holds otherwise (its parameters and state).
    late = split.gradless_after(zero.reduce_bucket_size * zero.grad_bytes)
    late -= back.get("parameter", 0) + back.get("buffer", 0) + state
    if late > 0 and late + reduced + in_hand > sum(backward.values()) - sum(persistent.values()):
        backward = {**persistent, "temp": late + reduced + in_hand}
    # Backward's epilogue flattens the last bucket into a tensor of its own (up to the bucket's size, or every
    # gradient's), which the collective holds until it completes: on gloo it was still alive when
    # grads_in_partition was made in 1 run in 5 (docs/fit-a-gpu.md). Both are counted.
    flat = min(zero.reduce_bucket_size, sum(groups)) * zero.grad_bytes
    epilogue = {**persistent, "temp": flat + reduced}
    # The optimizer's step, group by group: grads_in_partition flattened into the float32 gradient of the
    # partition (a copy; in 16 bits the flattened copy first, then its float32 one, the first deleted at once);
    # then the gradients' views into grads_in_partition freed (``free_grad_in_param_list``) and the optimizer
    # stepped on the partition, its temporaries beside. grads_in_partition is one tensor for every group: with
    # several, it lives until the last group's views go, so it is counted through the step.
    flattened = partition + (elements * zero.grad_bytes if zero.grad_bytes != FLOAT32 else 0)
    around = {"activation": opt.get("activation", 0), "other": opt.get("other", 0)}
    converting = {**persistent, **around, "gradient": flattened, "temp": opt.get("temp", 0) + reduced}
    step = {**persistent, **around, "optstate": persistent["optstate"] + stepping.temporaries, "gradient": partition,
            "temp": opt.get("temp", 0) + (reduced if len(groups) > 1 else 0)}
    # The reduce buffers live from backward's start to its end (``setup_buckets``, ``_release_ipg_buffers``): in
    # backward and its epilogue, not in the optimizer's step.
    buffers = zero.buffers.bytes
    moments = [(backward, buffers), (epilogue, buffers), (converting, 0), (step, 0)]
    at_peak, beside = max(moments, key=lambda m: sum(m[0].values()) + m[1])
    total = sum(at_peak.values()) + sum(h.bytes for h in split.held) + beside
    return replace(split, peak=total, at_peak={c: at_peak.get(c, 0) for c in split.at_peak} | at_peak,
                   held=(*split.held, zero.buffers) if beside else split.held, cuda_allocated=None,
                   cuda_reserved=None)


def rank_step3(split: StepSplit, zero: Zero3, partitions: int, trained: int, whole: int, stepping: Stepping,
               largest: int = 0, regather: int = 0) -> StepSplit:
    """A ZeRO-3 rank's whole step, from ``split``: the module's step on fake tensors with ZeRO-3's gathering played
    on it (``apply/zero3_gather.py``: the gathered parameters filed as parameters, the partitioned ones still whole
    besides, ``whole`` bytes). ``partitions``: elements of the rank's partitions of every parameter; ``trained``:
    of those trained; ``stepping``: the optimizer's state and temporaries on the rank's flat float32 partitions
    (``measure/flat_step.py``); ``largest``: elements of the largest parameter trained. What the rank holds besides
    (DeepSpeed 0.19, ``runtime/zero/stage3.py``, float32): its partitions of the parameters (one flat buffer), a
    float32 master copy of the trained ones (a copy even in float32: ``_create_fp32_partitions`` compares a device
    with a device's name), the gradients' partitions (``grad_partitions_flat_buffer``), the optimizer's state on
    the master copy, one reduce buffer (``reduce_bucket_size``). ``regather``: bytes the optimizer's step ends
    with, gathering the parameters kept whole again (``_post_step``: a flat buffer and their new copies).

    Offloaded (``zero.offload_optimizer``, ``zero.offload_param``), those terms are in host memory: the master
    copy, the gradients' partitions and the master copy's own float32 gradient (made once, kept: under offload
    ``_release_sub_group`` leaves it), the optimizer's state and its step's temporaries; the parameters'
    partitions. They count in the step only where the device is the host (``zero.host_is_device``); the split
    says them apart either way (``StepSplit.offloaded``)."""
    back, opt = split.gradless, split.in_optimizer
    state = back.get("optstate", 0)  # the module's optimizer state alive through its forward and backward
    own, master, grads = partitions * zero.element, trained * FLOAT32, trained * zero.element
    shard, temporaries = stepping.state, stepping.temporaries
    # Through the step, besides the module's own: on the device, and in host memory (offload)
    device = {"parameter": -whole, "gradient": 0, "optstate": 0}
    host = {"parameter": 0, "gradient": 0, "optstate": 0}
    (host if zero.offload_param else device)["parameter"] += own
    if zero.offload_optimizer:
        host.update(parameter=host["parameter"] + master, gradient=grads + master, optstate=shard)
    else:
        device.update(parameter=device["parameter"] + master, gradient=grads, optstate=shard)
    in_hand = largest * zero.element  # one gradient made whole before its copy into the reduce buffer
    # Forward and backward, the module's gradients left out (they go to the reduce buffer as backward makes them,
    # and the step before's are gone: the rank's are its partitions): its peak without them.
    backward = ({"parameter": back.get("parameter", 0) + device["parameter"], "buffer": back.get("buffer", 0),
                 "gradient": device["gradient"], "optstate": device["optstate"],
                 "activation": back.get("activation", 0), "temp": back.get("temp", 0) + in_hand,
                 "other": back.get("other", 0)}, host)
    # The optimizer's step: without offload, the gradients flattened into a float32 copy of the trained partition
    # (``_prepare_fp32_grad_for_sub_group``; in 16 bits a flattened copy first, freed once its float32 one is made),
    # then the optimizer's step on it with its temporaries: the larger of those two moments.
    around = {"parameter": opt.get("parameter", 0) + device["parameter"], "activation": opt.get("activation", 0),
              "temp": opt.get("temp", 0), "other": opt.get("other", 0), "buffer": opt.get("buffer", 0)}
    if zero.offload_optimizer:
        step = ({**around, "gradient": 0, "optstate": 0}, {**host, "optstate": shard + temporaries})
    else:
        converting = grads if zero.element != FLOAT32 else 0
        step = ({**around, "gradient": grads + master + max(converting - temporaries, 0),
                 "optstate": shard + temporaries}, host)
    # Its end: the float32 gradients gone, the parameters kept whole gathered again beside their old copies.
    ended = ({**step[0], "parameter": around["parameter"] + regather, "gradient": device["gradient"],
              "optstate": device["optstate"]}, host)
    # Backward's epilogue: the last bucket's gradients flattened for the reduce-scatter and its buffer beside
    # (``__avg_scatter_grads``), up to a bucket or every gradient; the activations gone, one gradient in hand.
    flat = min(zero.reduce_bucket_size, trained * zero.world) * zero.element
    epilogue = ({"parameter": around["parameter"], "buffer": opt.get("buffer", 0), "gradient": device["gradient"],
                 "optstate": device["optstate"], "temp": 2 * flat + in_hand}, host)

    def counted(moment: tuple[dict[str, int], dict[str, int]]) -> dict[str, int]:
        on, off = moment
        if not zero.host_is_device:
            return on
        return {c: on.get(c, 0) + off.get(c, 0) for c in {**on, **off}}

    # Mid-backward, each bucket DeepSpeed flushes is flattened for its reduce-scatter with the scatter's buffer
    # beside (as in the epilogue) while the activations still live (seen under Lightning with a block recomputed
    # whole: 2.9 % above the prediction before this moment was counted). What the module's backward held besides
    # its gradients then (:func:`_at_buckets`) holds the module's whole parameters and optimizer state: the rank's
    # are above (``device``).
    late = _at_buckets(split, zero.reduce_bucket_size * zero.element)
    reducing = ({"parameter": device["parameter"], "gradient": device["gradient"], "optstate": device["optstate"],
                 "temp": late - state + in_hand}, host) if late else backward
    on_device, offloaded = max(backward, reducing, step, ended, epilogue,
                               key=lambda m: sum(counted(m).values()))
    at_peak = counted((on_device, offloaded))
    buffers = Held(zero.reduce_bucket_size * zero.element,
                   f"DeepSpeed's reduce buffer (reduce_bucket_size={zero.reduce_bucket_size:g} elements)")
    total = sum(at_peak.values()) + sum(h.bytes for h in split.held) + buffers.bytes
    moved = sum(offloaded.values())
    where = "the device here: counted above" if zero.host_is_device else "not on the device: not counted"
    return replace(split, peak=total, at_peak={c: at_peak.get(c, 0) for c in split.at_peak} | at_peak,
                   held=(*split.held, buffers), cuda_allocated=None, cuda_reserved=None,
                   offloaded=Held(moved, f"offloaded to host memory ({where})") if moved else None)


@dataclass(frozen=True)
class ZeroSteps:
    """``ckpt.memory``'s whole step (``apply/memory.WholeSteps``) of one ZeRO rank: the module's own step
    (``steps``, on fake tensors; under ZeRO-3 with its gathering played on it), as :func:`rank_step` (ZeRO-1/2) or
    :func:`rank_step3` models the rank's."""

    steps: ModuleSteps
    zero: Zero | Zero3
    groups: tuple[int, ...]
    stepping: Stepping  # the optimizer's step on the rank's flat partitions (measure/flat_step.py)
    largest: int = 0  # elements of the largest parameter trained
    partitions: int = 0  # ZeRO-3: elements of the rank's partitions, of every parameter and of those trained
    trained: int = 0
    whole: int = 0  # ZeRO-3: bytes of the partitioned parameters whole
    regather: int = 0  # ZeRO-3: bytes of the optimizer's step's gathering of the parameters kept whole

    def of(self, plan: WrapPlan, rows: int | None = None) -> StepSplit:
        split = self.steps.of(plan, rows)
        if isinstance(self.zero, Zero3):
            return rank_step3(split, self.zero, self.partitions, self.trained, self.whole, self.stepping,
                              self.largest, self.regather)
        return rank_step(split, self.zero, self.groups, self.stepping, self.largest)

    @property
    def device(self) -> torch.device | None:
        return self.steps.device


def rank_steps(model: torch.nn.Module, loss: Callable[[int | None], Callable[[], Any]],
               optimizers: Sequence[torch.optim.Optimizer], held: Callable[[int | None], Sequence[Held]],
               zero: Zero | Zero3, redirected: bool = False) -> ZeroSteps:
    """A ZeRO rank's whole steps under ``zero``, from ``model``'s own: ``loss(rows)`` its step to the loss at
    ``rows`` samples, ``optimizers`` stepping it, ``held(rows)`` on the device beside it (the batch).
    ``redirected``: ZeRO-3's steps run as calls of ``model`` (Lightning's: ``apply/zero3_gather.gathering``)."""
    groups, largest = _trained_groups(optimizers, model), _largest_trained(model)
    stepping = _stepping(model, optimizers, zero)
    if not isinstance(zero, Zero3):  # the moments rank_step reads, the module in the dtype DeepSpeed casts it to
        steps = ModuleSteps(model, loss, optimizers, held, moments=True, around=lambda m: cast(m, zero.dtype))
        return ZeroSteps(steps, zero, groups, stepping, largest)

    @contextlib.contextmanager
    def around(m: torch.nn.Module) -> Iterator[None]:
        with cast(m, zero.dtype), gathering(m, zero, redirected):
            yield

    steps = ModuleSteps(model, loss, optimizers, held, moments=True, around=around)
    params = list({id(p): p for p in model.parameters()}.values())
    trained = {id(p) for o in optimizers for g in o.param_groups for p in g["params"] if p.requires_grad} or \
        {id(p) for p in params if p.requires_grad}
    kept = persistent(model, zero)
    return ZeroSteps(steps, zero, groups, stepping, largest,
                     partitions=sum(zero.partition(p.numel()) for p in params),
                     trained=sum(zero.partition(p.numel()) for p in params if id(p) in trained),
                     whole=sum(p.numel() * _size(p, zero) for p in params if id(p) not in kept),
                     regather=_regather([p for p in params if id(p) in kept], zero))


def _stepping(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], zero: Zero | Zero3) -> Stepping:
    """The optimizers' step on this rank's flat float32 partitions, as DeepSpeed makes them of each group's trained
    parameters: ZeRO-1/2 the group's flat buffer split over the world, ZeRO-3 each parameter's partition; on the
    host where ZeRO-3 offloads the optimizer."""
    def elements(params: Sequence[torch.Tensor]) -> int:
        trained = [p.numel() for p in params if p.requires_grad]
        if isinstance(zero, Zero3):
            return sum(zero.partition(n) for n in trained)
        return math.ceil(sum(trained) / zero.world)

    partitions = [[elements(g["params"]) for g in o.param_groups] for o in optimizers]
    offloaded = isinstance(zero, Zero3) and zero.offload_optimizer
    device = torch.device("cpu") if offloaded else next(model.parameters()).device
    return flat_stepping(optimizers, partitions, device)


def _at_buckets(split: StepSplit, bucket: int) -> int:
    """The most backward held at one of its reduce-scatters, besides the gradients, where buckets of ``bucket``
    bytes fill: what the module's backward held then (``StepSplit.gradless_at``: by the gradient bytes made, whose
    steps are the gradients as they arrive) and the flushed bucket flattened with the scatter's buffer beside
    (twice its contents). DeepSpeed flushes before a gradient that would overflow the bucket goes in (0: never)."""
    made = sorted(split.gradless_at)
    most, content, before = 0, 0, 0
    for at in made:
        arrived, before = at - before, at
        if content and content + arrived > bucket:
            most = max(most, split.gradless_at[at] + 2 * content)
            content = 0
        content += arrived
    return most


def _regather(kept: Sequence[torch.nn.Parameter], zero: Zero3) -> int:
    """Bytes of one all-gather of the parameters ``kept`` whole (DeepSpeed's ``_post_step``): one alone into a
    buffer of its own, which it keeps; several into a flat buffer, each copied out of it."""
    flat = sum(zero.partition(p.numel()) * zero.world * _size(p, zero) for p in kept)
    return flat if len(kept) < 2 else flat + sum(p.numel() * _size(p, zero) for p in kept)


def _size(p: torch.Tensor, zero: Zero3) -> int:
    """A parameter's element size once DeepSpeed cast the module (planning sees it before)."""
    return zero.element if p.is_floating_point() else p.element_size()


def _trained_groups(optimizers: Sequence[torch.optim.Optimizer], model: torch.nn.Module) -> tuple[int, ...]:
    """Elements of each parameter group DeepSpeed flattens: the optimizers' groups' trained parameters (the
    module's trained parameters as one group where no optimizer is given)."""
    groups = [sum(p.numel() for p in g["params"] if p.requires_grad) for o in optimizers for g in o.param_groups]
    return tuple(n for n in groups if n) or (sum(p.numel() for p in model.parameters() if p.requires_grad),)


def _largest_trained(model: torch.nn.Module) -> int:
    """Elements of the largest parameter that trains (0: none)."""
    return max((p.numel() for p in model.parameters() if p.requires_grad), default=0)


__all__ = ["Stepping", "Zero", "Zero3", "ZeroSteps", "cast", "rank_step", "rank_step3", "rank_steps"]

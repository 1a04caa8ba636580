"""Offload that can hide behind compute (issue #41, item 1): one host pool per installation, reused from the
second step on, and backward bringing the next layers' bytes back ahead of use, a bounded number of calls.

On CPU there is no device memory to leave, so the copy path is forced (``Offloading._in_host_memory``
emptied, as ``test_offload.py`` does for one context): the very copies, pool, order of calls and prefetches
run, with plain copies for the streams. What only a GPU shows (overlap, pinned memory, the allocator) is the
GPU check's (``ckpt_tools/gpu_check.py``) and the CUDA tests at the end.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt_batch, small_gpt
from test_offload import needs_cuda
from torch import nn
from torch.nn import functional as F

from ckpt_plugin import apply_checkpointing, remove_checkpointing
from ckpt_plugin.engine.host_pool import ALIGN, HostPool, aligned
from ckpt_plugin.engine.offload import Offloading, offloading
from ckpt_plugin.engine.offload_copies import Offloader
from ckpt_plugin.engine.wrap import offloaders_of


@pytest.fixture
def copies_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offloading context copies CPU tensors as if CPU were the device."""
    monkeypatch.setattr(Offloading, "_in_host_memory", ())


class Mixed(nn.Module):
    """A layer whose saves are views of one storage, several dtypes (float32, bfloat16, int64, bool), and a
    storage written in place after the op before it read it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.width = width
        self.qkv = nn.Linear(width, 3 * width)
        self.low = nn.Linear(width, width).to(torch.bfloat16)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.width, dim=-1)  # three views of one storage, each saved
        h = (q * k).softmax(-1) * v
        h = self.low(h.to(torch.bfloat16)).float()  # bfloat16 saves
        h = F.dropout(h, 0.25, self.training)  # a bool mask
        h = torch.gather(h, 1, index)  # an int64 index, saved
        h = self.out(h)
        h += x  # in place, after out's addmm read its own input (not h)
        return F.relu(h, inplace=True)  # relu_ saves its result: the storage written in place


class Net(nn.Module):
    """Three Mixed blocks, the middle one called twice (shared weights): four calls per step."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mixed(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def loss(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        for block in (self.blocks[0], self.blocks[1], self.blocks[1], self.blocks[2]):
            x = block(x, index)
        return self.head(x).square().mean()


def _batch(step: int, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(64, width, generator=g), torch.randint(0, width, (64, width), generator=g)


def _steps(model: nn.Module, loss, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Gradients of ``steps`` SGD steps, each on its own batch, dropout seeded alike in every run."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss(step).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return grads


def _assert_bitwise(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), (step, name)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


# --- the pool ------------------------------------------------------------------------


def test_the_pool_grows_on_the_first_step_then_takes_no_host_allocation():
    pool = HostPool(pinned=False)
    sizes = [3000, 1 << 20, 5, 70_000, 2 << 20]
    starts = []
    for step in range(3):
        regions = [pool.take(n) for n in sizes]
        assert [r.numel() for r in regions] == sizes
        starts.append([r.data_ptr() for r in regions])
        bases = [pool.slabs[0].data_ptr() if len(pool.slabs) == 1 else None]
        assert all(s % 64 == 0 for s in starts[-1])  # every dtype can view a region (64: c10's host alignment)
        if bases[0] is not None:
            assert all((s - bases[0]) % ALIGN == 0 for s in starts[-1])  # regions start ALIGN apart
        assert len(set(starts[-1])) == len(sizes)  # never one region twice within a step
        if step == 0:
            grown = pool.allocations
            assert grown > 1  # slab by slab
        for _ in regions:
            pool.give_back()
    assert pool.allocations == grown + 1 and len(pool.slabs) == 1  # one slab of the step's need, once
    assert starts[2] == starts[1]  # the very regions of the step before
    assert pool.need == sum(aligned(n) for n in sizes) == pool.slabs[0].numel()
    assert pool.started_over == 3


def test_the_pool_grows_again_for_a_larger_step_and_frees():
    pool = HostPool(pinned=False)
    pool.take(4 << 20)
    pool.give_back()
    before = pool.allocations
    pool.take(4 << 20)
    pool.give_back()
    assert pool.allocations == before
    pool.take(4 << 20)
    pool.take(8 << 20)  # more than the last step's need: the pool grows
    assert pool.allocations == before + 1
    pool.free()
    assert pool.held_bytes == 0


# --- bitwise over three steps, the pool reused ---------------------------------------------


@pytest.mark.parametrize("keys", [{"mode": "offload"}, {"mode": "full", "offload": True}],
                         ids=["offload", "full+offload"])
def test_three_steps_bitwise_with_the_pool_reused(copies_on_cpu, keys):
    """Views of one storage, bfloat16, int64 and bool saves, in-place writes and a layer called twice: each step's
    gradients bitwise those without offload, and no host allocation after the first step."""
    plain = _net()
    expected = _steps(plain, lambda s: plain.loss(*_batch(s)))
    model = _net()
    assert apply_checkpointing(model, layers="Mixed", **keys) == ["blocks.0", "blocks.1", "blocks.2"]
    (offloader,) = offloaders_of(model)
    allocations = []

    def loss(step: int) -> torch.Tensor:
        allocations.append(offloader.host_allocations)
        return model.loss(*_batch(step))

    got = _steps(model, loss)
    _assert_bitwise(expected, got)
    assert offloader.stats.copies_out > 0
    assert allocations[0] == 0 and allocations[1] > 0  # the first step grew the pool ...
    assert offloader.host_allocations == allocations[1]  # ... and nothing was allocated after it
    pool = offloader.pools[False]
    assert pool.live == 0 and pool.started_over == 3  # every region given back after each step's backward


def test_three_steps_bitwise_under_auto_where_it_plans_offload(copies_on_cpu, monkeypatch):
    """ckpt=auto over a link taken as unlimited (measure_link's answer replaced: no GPU here) plans offload for
    the layers a tight budget needs; three steps with its plan are bitwise those without, the pool reused."""
    from ckpt_plugin.apply.install import install_plan
    from ckpt_plugin.apply.plan import plan_for
    from ckpt_plugin.config.schema import make_config
    from ckpt_plugin.planning import link as links
    from ckpt_plugin.planning.offload_plan import Link

    monkeypatch.setattr(links, "measure_link", lambda device, *a, **k: Link(1e30, 1e30, "unlimited"))
    plain = _net()
    expected = _steps(plain, lambda s: plain.loss(*_batch(s)))
    model = _net()
    plan = plan_for(model, make_config(mode="auto", layers="Mixed", budget=0.6), lambda: model.loss(*_batch(0)))
    assert {str(o) for o in plan.planned.choices.values()} & {"offload", "full+offload"}, plan.summary
    install_plan(model, plan)
    (offloader,) = offloaders_of(model)
    allocations = []

    def loss(step: int) -> torch.Tensor:
        allocations.append(offloader.host_allocations)
        return model.loss(*_batch(step))

    _assert_bitwise(expected, _steps(model, loss))
    assert allocations[1] > 0 and offloader.host_allocations == allocations[1]


def test_backward_brings_back_each_call_and_the_next_ahead_of_use(copies_on_cpu):
    """Every call but the last comes back ahead of its use, and no more than ``ahead`` calls are on the device beside
    the one backward runs; in forward, no more than ``ahead`` calls stay on the device after each call ends."""
    model = _net()
    apply_checkpointing(model, layers="Mixed", mode="offload")
    (offloader,) = offloaders_of(model)
    fetched: list[tuple[int, bool]] = []
    order = []  # the calls, in forward order, as the offloader begins them
    begin, fetch = offloader.begin, offloader._fetch

    def logged_begin():
        call = begin()
        order.append(call)
        return call

    def logged_fetch(call, compute, on_demand):
        held = [c for c in order if c.stashed or any(x.on_device is not None for x in c.alive())]
        assert len(held) <= offloader.ahead + 1  # the call backward runs and at most `ahead` ahead
        fetched.append((order.index(call), on_demand))
        fetch(call, compute, on_demand)

    end = offloader.end
    stashed_after_end = []

    def logged_end(call):
        end(call)
        stashed_after_end.append(sum(c.stashed for c in order))

    offloader.begin, offloader._fetch, offloader.end = logged_begin, logged_fetch, logged_end
    model.loss(*_batch(0)).backward()
    assert stashed_after_end == [1, 1, 1, 1]  # ahead = 1: only the call that just ended
    assert len(order) == 4  # a layer called twice is two calls
    # The last call comes back on demand (nothing runs before it in backward); each other ahead of its use.
    assert fetched == [(3, True), (2, False), (1, False), (0, False)]
    copies = offloader.stats
    assert copies.on_demand == len(order[3].copies)
    assert copies.prefetched == copies.copies_out - copies.on_demand


def test_remove_checkpointing_frees_the_pool(copies_on_cpu):
    model = _net()
    apply_checkpointing(model, layers="Mixed", mode="offload")
    (offloader,) = offloaders_of(model)
    model.loss(*_batch(0)).backward()
    assert offloader.pools[False].held_bytes > 0
    remove_checkpointing(model)
    assert offloader.pools[False].held_bytes == 0 and offloaders_of(model) == []


def test_an_installation_shares_one_offloader_and_reinstalling_makes_a_new_one(copies_on_cpu):
    model = small_gpt(torch.float64)
    apply_checkpointing(model, layers="TransformerBlock", mode="offload")
    (first,) = offloaders_of(model)
    apply_checkpointing(model, layers="TransformerBlock", mode="offload")
    (second,) = offloaders_of(model)
    assert first is not second and first.pools[False].held_bytes == 0
    batch = gpt_batch(model)
    model.loss(batch).backward()
    assert second.stats.copies_out > 0


def test_a_context_reused_over_steps_reuses_its_pool():
    class _CopyOnCPU(Offloading):
        _in_host_memory = ()

    x = torch.randn(64, 64, requires_grad=True)
    off = _CopyOnCPU()
    for _ in range(3):
        with off:
            y = (x * 2).sin().cos()
        y.sum().backward()
    assert off.offloader.host_allocations == 1  # one slab, on the first step


def test_ahead_is_checked():
    with pytest.raises(ValueError, match=r"ckpt.offload: ahead must be a whole number of calls >= 0, got -1"):
        Offloader(ahead=-1)
    assert offloading(offloader=Offloader(ahead=0)).offloader.ahead == 0


# --- CUDA ----------------------------------------------------------------------------------

@needs_cuda
def test_cuda_three_steps_bitwise_pinned_and_no_host_allocation_after_the_first():
    plain = _net().cuda()
    expected = _steps(plain, lambda s: plain.loss(*(t.cuda() for t in _batch(s))))
    model = _net().cuda()
    apply_checkpointing(model, layers="Mixed", mode="offload")
    (offloader,) = offloaders_of(model)
    after_first = []

    def loss(step: int) -> torch.Tensor:
        if step == 1:
            after_first.append(offloader.host_allocations)
        return model.loss(*(t.cuda() for t in _batch(step)))

    _assert_bitwise(expected, _steps(model, loss))
    assert offloader.pools[True].slabs and offloader.pools[True].slabs[0].is_pinned()
    assert offloader.host_allocations == after_first[0]


# --- what the device holds, measured on fake tensors as on real ones ------------------------------


@pytest.mark.parametrize("keys", [{"mode": "offload"}, {"mode": "full", "offload": True}],
                         ids=["offload", "full+offload"])
def test_the_device_side_of_offload_on_fake_tensors_is_the_real_one(copies_on_cpu, keys):
    """A whole step (AdamW, MemTracker's categories) with offload installed, the copy path forced: on fake tensors
    the sources held until the next layer's end and the bytes brought back ahead of use are allocated as on real
    ones, byte for byte; and offload leaves the step fewer activation bytes than the same layers kept."""
    from ckpt_examples.gpt import GPT
    from ckpt_plugin.apply.install import install_plan
    from ckpt_plugin.apply.memory import whole_of
    from ckpt_plugin.apply.plan import plan_for
    from ckpt_plugin.config.schema import make_config
    from ckpt_plugin.engine.plan import WrapPlan
    from ckpt_plugin.measure.whole_step import whole_step

    torch.manual_seed(0)
    model = GPT(n_layer=4, n_embd=32, n_head=2, block_size=32, batch_size=4, dropout=0.0)
    forward = lambda m: (lambda: m(m.example_input_array))  # noqa: E731
    plan = plan_for(model, make_config(layers="TransformerBlock", **keys))
    fake = whole_of(model, plan, forward(model), [torch.optim.AdamW(model.parameters(), lr=1e-3)])
    real_model = __import__("copy").deepcopy(model)
    install_plan(real_model, plan)
    # On CPU the host pool is memory MemTracker sees; on a GPU it is not the device's. Grown before the measured
    # steps (and reused by them), it is not counted, as on a GPU.
    real_model(real_model.example_input_array).sum().backward()
    real_model.zero_grad(set_to_none=True)
    real = whole_step(real_model, forward(real_model), [torch.optim.AdamW(real_model.parameters(), lr=1e-3)],
                      fake=False)
    assert fake.peaks["act"] == real.peaks["act"] and fake.at_peak == real.at_peak
    kept = whole_of(model, WrapPlan() if keys["mode"] == "offload" else plan_for(model, make_config(
        layers="TransformerBlock", mode="full")), forward(model), [torch.optim.AdamW(model.parameters(), lr=1e-3)])
    assert real.peaks["act"] < kept.peaks["act"]

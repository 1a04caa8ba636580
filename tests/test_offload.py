"""Offloading saved activations to CPU memory (``ckpt_plugin.offload``).

On CPU there is nothing to move: the context must be an exact no-op that
says so once. The copy path itself (storages, views, dedup, versions) runs on
CPU through ``_CopyOnCPU``, a subclass that treats CPU memory as device memory.
The stream/pinned-memory path is tested on CUDA only.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from conftest import gpt_batch, small_gpt
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_plugin.measure.memory import saved_bytes
from ckpt_plugin.engine.offload import NOTHING_TO_MOVE, NothingToMoveNotice, Offloading, offloading, should_move
from ckpt_plugin.engine.offload_copies import Offloader
from ckpt_plugin import apply_checkpointing


def needs_cuda(test):
    """Skip without CUDA (conftest hides the GPUs unless CKPT_TEST_CUDA=1: the GPU check's CUDA tests)."""
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)


class _CopyOnCPU(Offloading):
    """Copies CPU tensors as if CPU were the device: the real copy path, runnable without a GPU."""

    _in_host_memory = ()


def _grads(model: nn.Module, batch, context: AbstractContextManager | None = None) -> dict[str, torch.Tensor]:
    """Gradients of one step, dropout replayed from the same seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with context if context is not None else nullcontext():
        loss = model.loss(batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# --- the decision: what moves ------------------------------------------------


def test_should_move_activations_not_parameters_nor_small():
    lin = nn.Linear(32, 32).double()
    x = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    act = lin(x)  # (8, 32) float64: 2048 bytes
    assert should_move(act, min_bytes=1024)
    assert should_move(act[:, :4], min_bytes=1024)  # a small view of a big storage: the storage counts
    assert should_move(act.detach(), min_bytes=1024)  # computed without grad (frozen layers) still moves
    assert not should_move(lin.weight, min_bytes=1024)  # parameter
    assert not should_move(lin.weight.t(), min_bytes=1024)  # view of a parameter
    frozen = nn.Parameter(torch.randn(32, 32), requires_grad=False)
    assert not should_move(frozen, min_bytes=1024)  # frozen parameters too
    assert not should_move(x, min_bytes=1024)  # leaf requiring grad: alive anyway
    assert not should_move(act, min_bytes=4096)  # small
    assert should_move(act, min_bytes=2048) and not should_move(act, min_bytes=2049)  # threshold is inclusive


def test_should_move_skips_what_bytes_cannot_describe():
    assert not should_move(torch.randn(64, 64).to_sparse(), min_bytes=0)
    assert not should_move(torch.randn(64, 64, dtype=torch.complex64).conj(), min_bytes=0)
    assert not should_move(torch.empty(64, 64, device="meta"), min_bytes=0)


@pytest.mark.parametrize("bad", [-1, 1.5, "1k", True])
def test_min_bytes_is_checked(bad):
    with pytest.raises(ValueError, match=r"ckpt.offload: min_bytes .* got " + repr(bad).replace(".", r"\.")):
        offloading(min_bytes=bad)


# --- CPU: nothing to move ----------------------------------------------------


def test_cpu_grads_bitwise_equal_and_nothing_moved():
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = _grads(model, batch)
    off = offloading()
    with pytest.warns(UserWarning, match=NOTHING_TO_MOVE):
        _assert_bitwise(plain, _grads(model, batch, off))
    assert off.stats.moved_bytes == 0 and off.stats.already_on_cpu > 0


def test_cpu_grads_bitwise_equal_with_checkpointing_inside():
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = _grads(model, batch)
    apply_checkpointing(model, layers="TransformerBlock")
    with pytest.warns(UserWarning, match=NOTHING_TO_MOVE):
        _assert_bitwise(plain, _grads(model, batch, offloading()))


@pytest.fixture
def said():
    """Every NOTHING_TO_MOVE warning, each one (``recwarn`` shows one per source line, as Python's default does)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [str(w.message) for w in caught if str(w.message) == NOTHING_TO_MOVE]


def test_cpu_warns_once_across_two_uses(said):
    """One context entered twice, or two contexts sharing one notice, say it once; a fresh context says it again."""
    x = torch.randn(64, 64, requires_grad=True)
    off, notice = offloading(), NothingToMoveNotice()
    for context in (off, off, offloading(notice=notice), offloading(notice=notice)):
        with context:
            y = (x * 2).sin()
        y.sum().backward()
    assert said() == [NOTHING_TO_MOVE] * 2
    with offloading():
        y = (x * 2).sin()
    y.sum().backward()
    assert said() == [NOTHING_TO_MOVE] * 3


def test_cpu_an_installation_warns_once_across_layers_and_steps(said):
    """The notice belongs to the installation (its Treatment): once for all its wrapped layers and steps, and
    again for another model's installation; nothing is left in the module between the two."""
    for _ in range(2):
        model = small_gpt(torch.float64)
        batch = gpt_batch(model)
        assert len(apply_checkpointing(model, layers="TransformerBlock", offload=True)) > 1
        for _ in range(2):
            _grads(model, batch)
    assert said() == [NOTHING_TO_MOVE] * 2


def test_cpu_a_checkpoint_transform_warns_once_across_calls(said):
    from ckpt_plugin import checkpoint as transform

    x = torch.randn(64, 64, requires_grad=True)
    f = transform(lambda t: (t * 2).sin(), offload=True)
    for _ in range(2):
        f(x * 2).sum().backward()  # the region's input, an activation, is what it saves
    assert said() == [NOTHING_TO_MOVE]


def test_cpu_nothing_to_move_returns_the_same_tensor():
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.warns(UserWarning, match=NOTHING_TO_MOVE), offloading() as off:
        h = x * 2  # (64, 64) float32: 16 KiB, an activation
        y = h.sin()  # saves h
    unpacked = y.grad_fn._saved_self  # goes through the unpack hook
    assert unpacked.data_ptr() == h.data_ptr()
    assert off.stats.already_on_cpu == 1 and off.stats.moved_bytes == 0


def test_stats_belong_to_the_last_use():
    x = torch.randn(64, 64, requires_grad=True)
    off = _CopyOnCPU()
    with off:
        (x * 2).sin()
    first = off.stats
    with off:
        pass
    assert first.moved_storages == 1 and off.stats.moved_storages == 0


# --- the copy path, run on CPU -----------------------------------------------


def test_copy_path_grads_bitwise_equal():
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = _grads(model, batch)
    off = _CopyOnCPU()
    _assert_bitwise(plain, _grads(model, batch, off))
    assert off.stats.moved_bytes > 0


def test_copy_path_moves_exactly_the_measured_saved_bytes_with_and_without_checkpointing():
    # `measure.saved_bytes` is how the project counts what autograd keeps (with
    # checkpointing: each region's inputs); with min_bytes=0 all of it moves.
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = _grads(model, batch)
    everything = _CopyOnCPU(min_bytes=0)
    _grads(model, batch, everything)
    assert everything.stats.moved_bytes == saved_bytes(model, lambda: model.loss(batch), []).total
    wrapped = apply_checkpointing(model, layers="TransformerBlock")
    inputs_only = _CopyOnCPU(min_bytes=0)
    _assert_bitwise(plain, _grads(model, batch, inputs_only))
    assert inputs_only.stats.moved_bytes == saved_bytes(model, lambda: model.loss(batch), wrapped).total
    assert inputs_only.stats.moved_bytes < everything.stats.moved_bytes / 4


def test_copy_path_restores_views_and_copies_a_storage_once():
    x = torch.randn(4, 8, 96, requires_grad=True)
    with _CopyOnCPU() as off:
        qkv = x * 2  # (4, 8, 96): one storage
        q, k, v = qkv.split(32, dim=2)  # three strided views of it
        y = q * k * v  # mul saves q, k and then (q*k), v
    assert off.stats.moved_bytes == qkv.untyped_storage().nbytes() + (q * k).untyped_storage().nbytes()
    assert off.stats.moved_storages == 2
    saved_v = y.grad_fn._saved_other
    assert saved_v.data_ptr() != v.data_ptr()  # a real copy ...
    assert (saved_v.size(), saved_v.stride(), saved_v.storage_offset()) == (v.size(), v.stride(), v.storage_offset())
    assert torch.equal(saved_v, v)  # ... with the same layout and values
    gx = torch.autograd.grad(y.sum(), x)[0]
    qd, kd, vd = (x.detach() * 2).split(32, dim=2)
    assert torch.equal(gx, torch.cat([kd * vd, qd * vd, qd * kd], dim=2) * 2)


def test_copy_path_copies_again_after_an_in_place_write():
    off = _CopyOnCPU()
    t = torch.randn(64, 64)
    before = t.clone()
    first = off._pack(t)
    t.add_(1)  # bumps t's version: same storage, new bytes
    second = off._pack(t)
    assert off.stats.moved_storages == 2
    assert torch.equal(off._unpack(first), before) and torch.equal(off._unpack(second), t)


def test_copy_path_keeps_parameters_and_small_tensors():
    lin = nn.Linear(64, 64)
    x = torch.randn(2, 64, requires_grad=True) * 1  # an activation of 512 bytes: small
    with _CopyOnCPU(min_bytes=1024) as off:
        out = lin(x)  # addmm saves x and weight.t() (a view of a parameter)
    assert out.grad_fn._saved_mat1.data_ptr() == x.data_ptr()
    assert out.grad_fn._saved_mat2.data_ptr() == lin.weight.data_ptr()
    assert off.stats.moved_bytes == 0 and off.stats.kept_on_device == 2


# --- CUDA ---------------------------------------------------------------------


@needs_cuda
def test_cuda_grads_bitwise_equal():
    model = small_gpt(torch.float64).cuda()
    batch = tuple(t.cuda() for t in gpt_batch(model))
    plain = _grads(model, batch)
    off = offloading()
    _assert_bitwise(plain, _grads(model, batch, off))
    assert off.stats.moved_bytes > 0 and off.stats.already_on_cpu == 0


@needs_cuda
def test_cuda_grads_bitwise_equal_with_checkpointing_inside():
    model = small_gpt(torch.float64).cuda()
    batch = tuple(t.cuda() for t in gpt_batch(model))
    plain = _grads(model, batch)
    apply_checkpointing(model, layers="TransformerBlock")
    off = offloading()
    _assert_bitwise(plain, _grads(model, batch, off))
    assert off.stats.moved_bytes > 0


@needs_cuda
def test_cuda_saved_bytes_leave_the_gpu():
    model = small_gpt(torch.float32, n_layer=4, n_embd=256, n_head=4, block_size=256).cuda()
    batch = tuple(t.cuda() for t in gpt_batch(model, batch=8))

    def held_and_peak(context: AbstractContextManager | None = None) -> tuple[int, int]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with context if context is not None else nullcontext():
            loss = model.loss(batch)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base  # what the forward keeps for backward
        loss.backward()
        torch.cuda.synchronize()
        return held, torch.cuda.max_memory_allocated() - base

    held_and_peak()  # warm up the allocator and kernels
    plain_held, plain_peak = held_and_peak()
    off = offloading()
    off_held, off_peak = held_and_peak(off)
    assert off.stats.moved_bytes > plain_held / 2
    assert off_held < plain_held / 2
    assert off_peak < plain_peak


@needs_cuda
def test_cuda_tiny_tensors_stay_big_ones_go_to_pinned_memory():
    off = offloading(min_bytes=1024, offloader=Offloader(ahead=0))  # ahead=0: the copy leaves the device at once
    tiny = torch.randn(16, device="cuda") * 2  # 64 bytes
    big = torch.randn(64, 64, device="cuda") * 2  # 16 KiB
    kept = off._pack(tiny)  # kept on the device: the same storage, detached (offload.py's _keep, pytorch#115255)
    assert kept.is_cuda and kept.data_ptr() == tiny.data_ptr() and off._unpack(kept) is kept
    packed = off._pack(big)
    copy = packed[0]
    assert copy.host.device.type == "cpu" and copy.host.is_pinned()
    restored = off._unpack(packed)
    assert restored.is_cuda and torch.equal(restored, big) and restored.data_ptr() != big.data_ptr()
    assert off.stats.kept_on_device == 1 and off.stats.moved_bytes == big.untyped_storage().nbytes()


@needs_cuda
def test_cuda_views_come_back_with_their_layout():
    x = torch.randn(4, 8, 96, device="cuda", requires_grad=True)
    with offloading() as off:
        q, k, v = (x * 2).split(32, dim=2)
        y = checkpoint(lambda a, b, c: a * b * c, q, k, v, use_reentrant=False)
    assert off.stats.moved_storages == 1  # q, k, v: one storage, copied once
    (gx,) = torch.autograd.grad(y.sum(), x)
    qd, kd, vd = (x.detach() * 2).split(32, dim=2)
    assert torch.equal(gx, torch.cat([kd * vd, qd * vd, qd * kd], dim=2) * 2)


def test_a_checkpoint_region_counts_only_its_inputs():
    """A non-reentrant region inside offloading is seen as its inputs, on every torch: torch 2.11 also saves a
    0-byte placeholder with them (``_compat.checkpoint_placeholder``), which no stat counts."""
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.warns(UserWarning, match=NOTHING_TO_MOVE), offloading() as off:
        h = x * 2
        checkpoint(torch.sin, h, use_reentrant=False)
    assert (off.stats.already_on_cpu, off.stats.kept_on_device, off.stats.moved_bytes) == (1, 0, 0)

"""The plugin's own measurements run on fake tensors, and count exactly what real tensors would.

Bytes and FLOPs depend only on shapes: the report's saved bytes and every
number of ``ckpt=auto``'s profile must be equal on fake and on real tensors,
on the example GPT and ResNet and on Hugging Face models called as their
users call them. What cannot run on fake tensors is said, never measured for real.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ckpt_plugin import apply_checkpointing
from ckpt_plugin._compat import fake_tensor_mode, is_fake
from ckpt_plugin.engine.wrap import checkpointing_disabled
from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.measure.memory import saved_bytes, side_effect_free
from ckpt_plugin.measure.report import measure_step, wrap_report
from ckpt_plugin.planning.options import FULL
from ckpt_plugin.planning.profile import profile
from tests.conftest import gpt_batch, resnet_batch, small_gpt, small_resnet

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(config), "GPT2Block"


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config), "LlamaDecoderLayer"


def _hf_call(model, **extra):
    """``model(input_ids=..., attention_mask=..., labels=...)`` with left padding, as HF users train."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(64, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :4] = 0
    return lambda: model(input_ids=ids, attention_mask=mask, labels=ids, **extra).loss


def _workloads():
    gpt = small_gpt()
    x, y = gpt_batch(gpt)
    resnet = small_resnet()
    images, labels = resnet_batch(resnet)
    gpt2, gpt2_layers = _gpt2()
    llama, llama_layers = _llama()
    return {
        "gpt": (gpt, "TransformerBlock", lambda: gpt.loss((x, y))),
        "resnet": (resnet, "Bottleneck", lambda: resnet.loss((images, labels))),
        "gpt2": (gpt2, gpt2_layers, _hf_call(gpt2)),
        "llama": (llama, llama_layers, _hf_call(llama)),
    }


@pytest.fixture(scope="module")
def workloads():
    return _workloads()


NAMES = ["gpt", "resnet", "gpt2", "llama"]


@pytest.mark.parametrize("name", NAMES)
def test_report_counts_on_fake_tensors_what_real_tensors_save(workloads, name):
    model, layers, forward = workloads[name]
    model.train()
    wrapped = apply_checkpointing(model, layers=layers)
    try:
        report = wrap_report(model, wrapped, forward)
        with side_effect_free(model), checkpointing_disabled(model):
            without = saved_bytes(model, forward, wrapped)
        with side_effect_free(model):
            with_ckpt = saved_bytes(model, forward, wrapped)
    finally:
        apply_checkpointing(model, mode="none")
    assert report.without.by_owner == without.by_owner
    assert report.with_ckpt.by_owner == with_ckpt.by_owner
    assert 0 < with_ckpt.total < without.total


@pytest.mark.parametrize("name", NAMES)
def test_auto_profile_on_fake_tensors_equals_the_profile_on_real_ones(workloads, name):
    model, layers, forward = workloads[name]
    if name in ("gpt2", "llama"):
        # The profile runs backward through recomputation, which replays HF's KV-cache update
        # unless the cache is off (what HF's own gradient checkpointing forces; issue #14).
        forward = _hf_call(model, use_cache=False)
    model.train()
    names = [n for n, m in model.named_modules() if type(m).__name__ == layers]
    real = profile(model, names, forward, fake=False)
    fake = profile(model, names, forward)
    assert all(layer.options[FULL].recompute_flops > 0 for layer in fake.layers)
    assert fake == real


def _rss_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, flags=re.MULTILINE)[1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak RSS through Linux's /proc")
def test_the_report_and_the_profile_allocate_no_activation_whatever_the_batch():
    """The process's peak while reporting and profiling at batch 64 grows by under a tenth
    of the bytes the un-checkpointed forward keeps (which the report counts: ~0.4 GiB)."""
    model = small_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128, dropout=0.0)
    x, y = gpt_batch(model, batch=64)
    wrapped = apply_checkpointing(model, layers="TransformerBlock")
    forward = lambda: model.loss((x, y))  # noqa: E731
    wrap_report(model, wrapped, forward)  # warm: lazy initialisation of torch and fake tensor kernels
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    before = _rss_kib("VmRSS")
    report = wrap_report(model, wrapped, forward)
    profile(model, wrapped, forward)
    grown = (_rss_kib("VmHWM") - before) * 1024
    without = report.without.total
    assert without > 256 * 2**20
    assert grown < without / 10, (grown, without)


class ReadsValues(nn.Module):
    """A forward that branches on data, which fake tensors do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return self.inner(x).relu()
        return self.inner(x)


def test_a_forward_that_reads_values_is_measured_on_fake_tensors_as_real_ones_count():
    """The branch on ``.item()`` is answered from one forward without autograd (``measure/values.py``)."""
    model = ReadsValues()
    wrapped = apply_checkpointing(model, layers="inner*")
    for x in (torch.ones(2, 4), -torch.ones(2, 4)):  # both branches
        fake, real = (measure_step(model, lambda: model(x), wrapped, fake=f) for f in (True, False))
        assert (fake.kept, fake.peaks) == (real.kept, real.peaks)
        with checkpointing_disabled(model):
            fake, real = (measure_step(model, lambda: model(x), wrapped, fake=f) for f in (True, False))
        assert (fake.kept, fake.peaks) == (real.kept, real.peaks)
    assert [layer.name for layer in profile(model, wrapped, lambda: model(torch.ones(2, 4)).sum()).layers] == wrapped


def test_on_fake_tensors_passes_other_errors_through():
    model = small_gpt()
    with pytest.raises(ValueError, match="^not about fake tensors$"):
        with on_fake_tensors(model, "a test"):
            raise ValueError("not about fake tensors")


class _AllReal(TorchDispatchMode):
    """Counts the calls with no fake tensor among their arguments (BatchNorm's step count): torch's to decide."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs or {}))
        self.calls += any(isinstance(t, torch.Tensor) for t in leaves) and not any(is_fake(t) for t in leaves)
        return func(*args, **(kwargs or {}))


def test_a_real_model_on_a_fake_batch_is_cached_as_a_fake_one():
    """Planning runs the model's real parameters on fake inputs; torch's fake mode would pass its cache by for
    every such call (and run BatchNorm's Python decomposition each time). Converted first (``_compat/fake.py``),
    only calls without any fake tensor pass it by, and the second pass of a ResNet's step misses it nowhere."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = small_resnet()
    x, y = resnet_batch(model)
    mode = fake_tensor_mode()
    with mode:
        batch = (mode.from_tensor(x), mode.from_tensor(y))
        model.loss(batch).backward()  # the first pass fills the cache
        model.zero_grad(set_to_none=True)
        bypassed, misses = FakeTensorMode.cache_bypasses["non-fake tensor"], FakeTensorMode.cache_misses
        with _AllReal() as all_real:
            model.loss(batch).backward()
        model.zero_grad(set_to_none=True)
    assert 0 < all_real.calls < 20  # a step count per BatchNorm, the fc weight's transpose
    assert FakeTensorMode.cache_bypasses["non-fake tensor"] - bypassed == all_real.calls
    assert FakeTensorMode.cache_misses == misses


def test_a_measurement_sets_the_heap_aside_for_the_collector_and_puts_it_back():
    """Inside a measurement the objects alive before it are frozen out of the collector's passes (gc.freeze: a
    full pass walked all of torch's and Lightning's); after it they are collectable again. A heap the process
    froze itself stays as the process left it."""
    model = small_gpt()
    x, _ = gpt_batch(model)
    frozen: list[int] = []
    model.blocks[0].register_forward_hook(lambda *_: frozen.append(gc.get_freeze_count()))

    def measure() -> None:
        with on_fake_tensors(model, "a test"):
            model(x).sum().backward()

    assert gc.get_freeze_count() == 0
    measure()
    assert frozen[0] > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # the process's own
    try:
        own = gc.get_freeze_count()
        measure()
        # Not frozen again (the objects made since would have joined) nor unfrozen (none would be left); a frozen
        # object can still die meanwhile (CI: 2 of 1.7 million), leaving the permanent generation.
        assert frozen[1] <= own and 0 < gc.get_freeze_count() <= own
        assert own - gc.get_freeze_count() < 1000
    finally:
        gc.unfreeze()

"""Segments and recursive checkpointing: schedules, correctness, memory, recompute, errors."""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn

from ckpt_plugin import ActivationCheckpointing, apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin.measure.memory import REST, saved_bytes, step_flops, step_memory
from ckpt_plugin.engine.segments.sequential import Region, checkpoint_sequential, regions, schedule


def grads(model: nn.Module, batch, seed: int = 3):
    torch.manual_seed(seed)
    loss = model.loss(batch)
    loss.backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), out


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


# ----------------------------------------------------------------------------- schedules


def test_fixed_segments_partition_the_chain() -> None:
    assert schedule(10, 3) == [Region(0, 3, (0, 1, 2)), Region(3, 7, (3, 4, 5, 6)), Region(7, 10, (7, 8, 9))]
    assert schedule(4, 1) == [Region(0, 4, (0, 1, 2, 3))]
    assert [(r.start, r.stop) for r in schedule(64, "sqrt")] == [(i * 8, i * 8 + 8) for i in range(8)]


def test_recursive_halves_down_to_single_layers() -> None:
    nodes = schedule(64, "recursive")
    depth = lambda n: 1 + max((depth(c) for c in n.children if isinstance(c, Region)), default=0)  # noqa: E731
    assert [(r.start, r.stop) for r in nodes] == [(0, 32), (32, 64)]
    assert max(depth(r) for r in nodes) == int(math.log2(64)) - 1  # regions of 32, 16, 8, 4, 2 layers
    assert len(regions(nodes)) == 64 - 2  # a full binary tree over 64 leaves, less the root


# ----------------------------------------------------------------------------- checkpoint_sequential


@pytest.mark.parametrize("segments", [1, 4, 64, "sqrt", "recursive"])
def test_checkpoint_sequential_of_plain_callables(segments) -> None:
    x = torch.randn(256, dtype=torch.float64, requires_grad=True)
    y = x
    for _ in range(64):
        y = torch.sin(y)
    expected = torch.autograd.grad(y.sum(), x)[0]
    out = checkpoint_sequential([torch.sin] * 64, segments, x)
    assert torch.equal(out, y)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)


def test_checkpoint_sequential_of_modules_with_dropout() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()) for _ in range(6)]).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(1)
    net(x).sum().backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch.manual_seed(1)
    checkpoint_sequential(net, "recursive", x).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(net.parameters(), expected))


def test_recursive_keeps_logarithmic_inputs_on_a_64_block_chain() -> None:
    torch.manual_seed(0)
    width, batch, L = 128, 16, 64
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(L)])
    x = torch.randn(batch, width)
    unit = batch * width * 4  # one (B, width) float32 activation: a block's input

    def run(segments):
        def step():
            y = net(x) if segments is None else checkpoint_sequential(net, segments, x)
            y.sum().backward()
            net.zero_grad(set_to_none=True)

        return step_memory(step, net)["act"], step_flops(step)

    plain_act, plain_flops = run(None)
    rec_act, rec_flops = run("recursive")
    # Plain keeps every block's activations: at least L block inputs.
    assert plain_act >= L * unit
    # Recursive keeps ~2 inputs per level of the tree (log2 L levels) plus one block's
    # activations (its Linear input and Tanh output) and the backward's working tensors.
    assert rec_act <= (2 * math.log2(L) + 4) * unit
    # And pays for it with at most one extra forward per level.
    forward = plain_flops // 3  # backward of a Linear is twice its forward
    assert plain_flops < rec_flops <= plain_flops + math.log2(L) * forward


# ----------------------------------------------------------------------------- module segments


@pytest.mark.parametrize("segments", [1, 2, 4, "sqrt", "recursive"])
def test_gpt_segments_give_bitwise_equal_gradients(segments) -> None:
    plain, wrapped = small_gpt(torch.float64, n_layer=8), small_gpt(torch.float64, n_layer=8)
    batch = gpt_batch(plain)
    names = apply_checkpointing(wrapped, layers="TransformerBlock", segments=segments)
    assert names == [f"blocks.{i}" for i in range(8)] == wrapped_modules(wrapped)
    assert_same(grads(plain, batch), grads(wrapped, batch))


def test_resnet_bottleneck_segments_across_stages_keep_batchnorm_exact() -> None:
    plain, wrapped = small_resnet(torch.float64), small_resnet(torch.float64)
    batch = resnet_batch(plain, dtype=torch.float64)
    assert apply_checkpointing(wrapped, layers="Bottleneck", segments=2) == [
        "stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1",
    ]
    for _ in range(2):
        assert_same(grads(plain, batch), grads(wrapped, batch))
    for (k, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        assert torch.equal(a, b), k  # running stats and num_batches_tracked included


def test_segments_keep_s_inputs_plus_one_segment() -> None:
    L, S = 8, 2
    model = small_gpt(n_layer=L, n_embd=64, block_size=64)
    batch = gpt_batch(model, batch=4)
    blocks = [f"blocks.{i}" for i in range(L)]
    forward = lambda: model.loss(batch)  # noqa: E731
    plain = saved_bytes(model, forward, blocks)

    def step():
        model.loss(batch).backward()
        model.zero_grad(set_to_none=True)

    plain_flops = step_flops(step)
    apply_checkpointing(model, layers="TransformerBlock", segments=S)
    seg = saved_bytes(model, forward, blocks)
    block_input = 4 * 64 * 64 * 4
    # After the forward: exactly S segment inputs beyond what lies outside the blocks.
    assert seg.total == plain.by_owner[REST] + S * block_input
    # During the step: at most S inputs + what lies outside + one segment's activations.
    one_segment = sum(plain.by_owner[n] for n in blocks[: L // S])
    assert step_memory(step, model)["act"] <= S * block_input + plain.by_owner[REST] + one_segment
    # And exactly one extra forward of the blocks... at most (torch stops recomputing early when it can).
    assert plain_flops < step_flops(step) <= plain_flops * 4 // 3 + 1


def test_remove_takes_every_hook_away() -> None:
    model = small_gpt()
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    apply_checkpointing(model, layers="TransformerBlock", segments=2)
    assert hooks() == 8
    assert remove_checkpointing(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert hooks() == 0 and wrapped_modules(model) == []
    assert all("_ckpt_plugin_chain" not in m.__dict__ for m in model.modules())


def test_segments_through_the_lightning_callback(tmp_path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        model = small_gpt(n_layer=4)
        data = torch.randint(96, (8, 17), generator=torch.Generator().manual_seed(0))
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=3, precision="64-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path,
        )
        trainer.fit(model, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2))
        return model

    callback = ActivationCheckpointing(layers="TransformerBlock", segments="recursive")
    a, b = fit([]), fit([callback])
    assert callback.wrapped == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert wrapped_modules(b) == []
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k


# ----------------------------------------------------------------------------- errors


def test_more_segments_than_layers() -> None:
    model = small_gpt()
    with pytest.raises(ValueError, match=r"^ckpt\.segments=5 asks for more segments than the 4 layers of the chain; "
                       r"use a value from 1 to 4, 'sqrt' or 'recursive'$"):
        apply_checkpointing(model, layers="TransformerBlock", segments=5)
    assert wrapped_modules(model) == []


@pytest.mark.parametrize("bad", [0, -2])
def test_segments_below_one(bad) -> None:
    with pytest.raises(ValueError, match=rf"^ckpt\.segments={bad} must be >= 1"):
        apply_checkpointing(small_gpt(), layers="TransformerBlock", segments=bad)


def test_segments_of_a_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"^ckpt\.segments='half' \(str\) must be an integer >= 1, 'sqrt', 'recursive' or 'optimal'"):
        apply_checkpointing(small_gpt(), layers="TransformerBlock", segments="half")


def test_segments_with_every_n() -> None:
    with pytest.raises(ValueError, match=r"^ckpt\.segments=2 cannot be combined with ckpt\.every_n=2"):
        apply_checkpointing(small_gpt(), layers="TransformerBlock", segments=2, every_n=2)


def test_segments_over_layers_that_are_not_in_a_sequential() -> None:
    model = small_gpt()
    with pytest.raises(ValueError, match=r"ckpt\.segments: blocks\.0\.attn is a child of blocks\.0 \(TransformerBlock\), "
                       r"not of an nn\.Sequential or nn\.ModuleList"):
        apply_checkpointing(model, layers="CausalSelfAttention", segments=2)
    assert wrapped_modules(model) == []


class Residual(nn.Module):
    """A ModuleList used with a residual in the parent: not a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_parent_that_is_not_a_chain_is_an_error_never_a_wrong_gradient() -> None:
    model = Residual()
    apply_checkpointing(model, layers="Linear", segments=2)
    with pytest.raises(RuntimeError, match=r"^ckpt\.segments: blocks\.1 did not take blocks\.0's output as its one "
                       r"input \(it got a different value\), so these layers are not a chain"):
        model(torch.randn(2, 4, requires_grad=True))
    # Nothing is left open: autograd still works, and so does the model once unwrapped.
    remove_checkpointing(model)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


class Masked(nn.Module):
    """A block that takes its mask as a keyword argument, as a Llama decoder layer does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x, mask=None, scale=1.0, **extra):
        return torch.tanh(self.fc(x)) * mask * scale


class MaskedNet(nn.Module):
    """``x = block(x, mask=mask, scale=0.5)``; ``odd`` makes block 1's arguments differ from block 0's."""

    def __init__(self, odd: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Masked() for _ in range(4))
        self.odd = odd

    def forward(self, x, mask):
        for i, block in enumerate(self.blocks):
            kwargs = {"mask": mask, "scale": 0.5}
            if i == 1 and self.odd == "tensor":
                kwargs["mask"] = mask.clone()  # equal values, another tensor: its gradient would go elsewhere
            elif i == 1 and self.odd == "value":
                kwargs["scale"] = 0.25
            elif i == 1 and self.odd == "keys":
                kwargs["bias"] = None
            x = block(x, **kwargs)
        return x.sum()


@pytest.mark.parametrize("segments", [1, 2, "recursive"])
def test_segments_over_layers_given_the_same_keyword_arguments(segments) -> None:
    def step(model):
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        mask = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
        model(x, mask).backward()
        return [p.grad for p in model.parameters()] + [mask.grad]

    plain, ours = MaskedNet(), MaskedNet()
    assert apply_checkpointing(ours, layers="Masked", segments=segments) == [f"blocks.{i}" for i in range(4)]
    # The mask's gradient too: the recomputation passes the very tensor to every layer.
    assert all(torch.equal(a, b) for a, b in zip(step(plain), step(ours), strict=True))


@pytest.mark.parametrize(("odd", "got"), [
    ("tensor", "got other values than blocks.0 for the keyword arguments ['mask']"),
    ("value", "got other values than blocks.0 for the keyword arguments ['scale']"),
    ("keys", "got the keyword arguments ['bias', 'mask', 'scale'], blocks.0 ['mask', 'scale']"),
])
def test_a_layer_given_other_keyword_arguments_than_its_segment_is_an_error(odd, got) -> None:
    model = MaskedNet(odd)
    apply_checkpointing(model, layers="Masked", segments=2)
    mask = torch.ones(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="^" + re.escape(
            f"ckpt.segments: blocks.1 did not take blocks.0's output as its one input (it {got}), so these layers "
            "are not a chain and a segment cannot be recomputed from its first input. Use segments only over layers "
            "that feed each other one tensor and all get the same keyword arguments (an nn.Sequential, or a "
            "ModuleList applied as x = layer(x, **kwargs)), or set ckpt.segments=null to checkpoint each layer.") + "$"):
        model(torch.randn(3, 4, dtype=torch.float64, requires_grad=True), mask)

"""Op groups (``engine/op_groups.py``): regions inside a layer's own ``forward``, for ``ckpt=auto`` below
what its child modules reach (issue #23: the example ResNet at 0.5).

Checked as every engine piece is: the regrouped forward is bitwise the module's
own (outputs, gradients, BatchNorm statistics), ``state_dict`` and parameters
are untouched, removal restores the module, a call the trace does not describe
runs the module's own forward; and through ``ckpt=auto``: the plan meets its
budget by MemTracker's act peak, predicted to the byte, with gradients bitwise
those without checkpointing.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import resnet_batch, small_resnet
from torch import nn

from ckpt_plugin import remove_checkpointing
from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.op_groups import OpGroup, is_regrouped, op_groups, regroup, ungroup
from ckpt_plugin.engine.wrap import install, wrapped_modules
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import step_memory
from ckpt_plugin.planning.profile import INSIDE_DEPTH, profile

pytestmark = pytest.mark.usefixtures("one_thread")


def _step(model, batch, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the blocks' dropout draws the same masks
    loss = model.loss(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_a_bottleneck_is_cut_after_each_relu_into_a_left_deep_tree() -> None:
    block = small_resnet(depths=(1,)).stages[0][0]
    found = op_groups(block)
    assert found is not None
    # conv1 bn1 relu | conv2 bn2 relu | conv3 bn3 drop: the head (two units) and the last unit;
    # the shortcut and the residual add and ReLU stay the block's own.
    assert found.parts == ["conv1-relu_1", "conv3-drop", "shortcut"]
    head, last = found.groups["conv1-relu_1"], found.groups["conv3-drop"]
    assert [(n, g.ops) for n, g in head.named_children()] == [
        ("conv1-relu", ("conv1", "bn1", "relu")), ("conv2-relu_1", ("conv2", "bn2", "relu_1"))]
    assert last.ops == ("conv3", "bn3", "drop") and not list(last.children())
    assert not is_regrouped(block)  # op_groups only looks


def test_regrouping_changes_no_number_and_no_key_and_comes_off() -> None:
    """Every parameter's gradient, the loss and every BatchNorm statistic bitwise; state_dict's keys and the
    parameters as they were (a group owns nothing); ungroup gives back the module as it was."""
    model = small_resnet()
    batch = resnet_batch(model)
    plain = copy.deepcopy(model)
    blocks = [m for m in model.modules() if type(m).__name__ == "Bottleneck"]
    assert all(regroup(b) for b in blocks)
    assert all(isinstance(getattr(b, "conv3-drop"), OpGroup) for b in blocks)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    (loss, grads), (loss0, grads0) = _step(model, batch), _step(plain, batch)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), plain.buffers(), strict=True))
    for b in blocks:
        ungroup(b)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert all("forward" not in b.__dict__ for b in blocks)


def test_a_call_the_trace_does_not_describe_runs_the_modules_own_forward() -> None:
    """Traced in training mode, the graph fixed what Python decided then: in eval mode the module's own
    forward runs (a functional dropout's ``training=self.training`` would otherwise stay on)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.dropout(F.gelu(self.a(x)), 0.5, training=self.training)
            return F.relu(self.b(h))

    block = Block().train()
    assert regroup(block)
    x = torch.randn(4, 8)
    block.eval()
    assert torch.equal(block(x), Block.forward(block, x))  # no dropout in eval mode
    called = []
    block.__dict__["forward"].inner = lambda *a: called.append(a) or x  # the own forward, seen from outside
    block(x)
    block.train()
    block(x)
    assert len(called) == 1  # eval: the own forward; train: the traced one


@pytest.mark.parametrize("why, forward", [
    ("control flow on a tensor", lambda self, x: self.a(x) if x.sum() > 0 else F.relu(self.b(x))),
    ("a parameter of its own (get_attr)", lambda self, x: F.relu(self.b(F.relu(self.a(x)) * self.scale))),
    ("one unit per chain", lambda self, x: self.b(self.a(x)) + x),
])
def test_a_forward_without_groups_keeps_its_child_modules_as_parts(why: str, forward) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.ones(8))

    Block.forward = forward
    block = Block()
    assert op_groups(block) is None, why
    assert not regroup(block) and not is_regrouped(block) and "forward" not in block.__dict__


def test_resnet_auto_half_goes_inside_its_blocks_forward_and_holds_its_budget() -> None:
    """The example ResNet's least peak by its blocks' child modules is 0.65 of the peak without
    checkpointing; inside its Bottlenecks' forward, 0.5 is met: predicted to the byte, MemTracker's act
    peak within it, gradients and BatchNorm statistics bitwise, the plan naming the groups it wraps."""
    model = small_resnet()
    batch = resnet_batch(model)
    _, grads0 = _step(model, batch)
    buffers0 = [b.clone() for b in model.buffers()]
    none = step_memory(lambda: _step(model, batch), model)["act"]
    for b, b0 in zip(model.buffers(), buffers0):  # the measured step moved the statistics: back to before
        b.copy_(b0)
    config = make_config(mode="auto", layers=["Bottleneck", "re:stem"], budget=0.5)
    plan = plan_for(model, config, lambda: model.loss(batch))
    install(model, plan)
    try:
        chosen = plan.planned
        assert any(".conv1-relu_1" in n or ".conv3-drop" in n for n in chosen.choices), chosen.choices
        assert plan.regroup and all(is_regrouped(model.get_submodule(n)) for n in plan.regroup)
        assert any("-" in n.rsplit(".", 1)[-1] for n in wrapped_modules(model))
        act = step_memory(lambda: _step(model, batch), model)["act"]
        assert act == chosen.predicted_peak <= none * 0.5
        for b, b0 in zip(model.buffers(), buffers0):
            b.copy_(b0)
        _, grads = _step(model, batch)
        assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
        groups = [n for n in chosen.choices if "-" in n.rsplit(".", 1)[-1]]
        # Indented under its layer, a group inside a group (full with its parts inside, chosen by the timings on
        # a loaded machine: stages.0.1.conv1-relu_1.conv2-relu_1) under that group: two spaces a listed ancestor.
        depth = lambda n: sum(n.startswith(a + ".") for a in chosen.choices)  # noqa: E731
        assert groups and all(depth(n) and f"\n{'  ' * depth(n)}{n} " in plan.summary for n in groups), plan.summary
    finally:
        remove_checkpointing(model)
    assert not any(is_regrouped(m) for m in model.modules())
    assert not any(isinstance(m, OpGroup) for m in model.modules())


def test_a_budget_below_what_the_groups_reach_names_the_least_peak() -> None:
    model = small_resnet()
    batch = resnet_batch(model)
    before = [n for n, _ in model.named_modules()]
    config = make_config(mode="auto", layers=["Bottleneck", "re:stem"], budget=0.1)
    with pytest.raises(ConfigError) as err:
        apply_config(model, config, forward=lambda: model.loss(batch))
    problem = err.value.problems[0]
    assert problem.key == "ckpt.budget" and problem.least > problem.value  # the least reachable, as data
    assert [n for n, _ in model.named_modules()] == before  # a refusal leaves no group behind


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b(F.relu(self.a(x)))) * gate + x


class _GatedNet(nn.Module):
    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Gated() for _ in range(3))
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x.mean(dim=0))
        for block in self.blocks:
            x = block(x, gate=gate) if self.by_keyword else block(x, gate)
        return x


@pytest.mark.parametrize("by_keyword", [False, True])
def test_auto_regroups_a_layer_only_where_its_groups_run(by_keyword: bool) -> None:
    """Called as traced (positionally, with tensors), a layer's parts are its op groups; called with a
    keyword, its own forward runs (the trace does not describe that call), so its parts stay its child
    modules, as without op groups, and nothing is left regrouped."""
    torch.manual_seed(0)
    model = _GatedNet(by_keyword)
    x = torch.randn(8, 16)
    names = ["blocks.0", "blocks.1", "blocks.2"]
    prof = profile(model, names, lambda: model(x).square().sum(), depth=INSIDE_DEPTH)
    if by_keyword:
        assert prof.regrouped == ()
        assert {"blocks.0.a", "blocks.0.b"} <= set(prof.parts)
    else:
        assert prof.regrouped == tuple(names)
        assert {"blocks.0.a-relu", "blocks.0.b-relu_1"} <= set(prof.parts)  # the chain: two units, no head tree
    assert not any(is_regrouped(m) for m in model.modules())


class _TorchvisionBottleneck(nn.Module):
    """torchvision's Bottleneck layout: one in-place ReLU module called three times, a downsample or None,
    the residual added in place. The shared ReLU is no part of its own (called thrice), so by child modules
    alone the block cannot be split; its op groups can."""

    def __init__(self, c: int, stride: int = 1) -> None:
        super().__init__()
        w = c // 4
        self.conv1, self.bn1 = nn.Conv2d(c, w, 1, bias=False), nn.BatchNorm2d(w)
        self.conv2, self.bn2 = nn.Conv2d(w, w, 3, stride, 1, bias=False), nn.BatchNorm2d(w)
        self.conv3, self.bn3 = nn.Conv2d(w, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(c, c, 1, stride, bias=False), nn.BatchNorm2d(c))
                           if stride != 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class _TorchvisionLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(*(_TorchvisionBottleneck(32, s) for s in (1, 1, 2, 1)))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def test_a_torchvision_bottleneck_reaches_below_its_child_modules_least_peak(monkeypatch) -> None:
    x, y = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([1, 2, 3, 4])

    def build() -> _TorchvisionLike:
        torch.manual_seed(0)
        return _TorchvisionLike().train()

    def step(model: nn.Module) -> dict[str, torch.Tensor]:
        torch.manual_seed(3)
        F.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    config = make_config(mode="auto", layers=["_TorchvisionBottleneck", "re:stem"], budget="min")
    model = build()
    plan = plan_for(model, config, lambda: F.cross_entropy(model(x), y))
    install(model, plan)
    act = step_memory(lambda: step(model), model)["act"]
    assert plan.regroup and act == plan.planned.predicted_peak
    again = build()
    install(again, plan_for(again, config, lambda: F.cross_entropy(again(x), y)))
    grads, plain = step(again), step(build())
    assert all(torch.equal(grads[n], plain[n]) for n in plain)
    with monkeypatch.context() as patch:  # the same model, its blocks split by child modules only
        patch.setattr("ckpt_plugin.engine.op_groups.op_groups", lambda module: None)
        unsplit = build()
        least = plan_for(unsplit, config, lambda: F.cross_entropy(unsplit(x), y)).planned.predicted_peak
    assert act < least


def test_a_regrouped_model_deep_copies_and_pickles_with_its_groups() -> None:
    """The copy's groups call the copy's modules; a step of it is bitwise the original's. Pickled whole
    (torch.save of the model), the groups come back; the plugin's checkpoint contexts do not, and the first
    step says so and how to re-apply, which then trains bitwise."""
    model = small_resnet()
    batch = resnet_batch(model)
    config = make_config(mode="auto", layers=["Bottleneck", "re:stem"], budget=0.5)
    plan = plan_for(model, config, lambda: model.loss(batch))
    install(model, plan)
    before = [b.clone() for b in model.buffers()]
    twin = copy.deepcopy(model)
    block = twin.get_submodule(plan.regroup[0])
    assert block.conv1 in getattr(block, "conv1-relu_1").calls()
    assert all(m is not model.get_submodule(plan.regroup[0]).conv1 for m in getattr(block, "conv1-relu_1").calls())
    _, grads = _step(model, batch)
    _, twin_grads = _step(twin, batch)
    assert all(torch.equal(grads[n], twin_grads[n]) for n in grads)
    buffer = io.BytesIO()
    torch.save(twin, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for b, b0 in zip(loaded.buffers(), before, strict=True):
        b.copy_(b0)
    with pytest.raises(RuntimeError, match=r"this checkpointed module was unpickled .*remove_checkpointing"):
        _step(loaded, batch)
    remove_checkpointing(loaded)
    install(loaded, plan)
    for b, b0 in zip(loaded.buffers(), before, strict=True):
        b.copy_(b0)
    _, loaded_grads = _step(loaded, batch)
    assert all(torch.equal(grads[n], loaded_grads[n]) for n in grads)


def test_a_lightning_trainer_trains_the_resnet_inside_its_blocks_forward_bitwise(tmp_path: Path) -> None:
    """The callback plans ``ckpt=auto`` at 0.5 on the ResNet (it goes inside the Bottlenecks' forward),
    three steps train, and the final weights and BatchNorm statistics are bitwise those of the same fit
    without the callback; teardown takes the groups away with the wrappers."""
    import lightning.pytorch as pl

    from ckpt_examples.data import ImageData
    from ckpt_examples.resnet import ResNet
    from ckpt_plugin import ActivationCheckpointing

    class Seen(pl.Callback):
        def __init__(self) -> None:
            self.groups: list[list[str]] = []  # the op groups in the model at each batch

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.groups.append([n for n, m in pl_module.named_modules() if isinstance(m, OpGroup)])

    def fit(callbacks: list) -> ResNet:
        pl.seed_everything(0, verbose=False)
        model = ResNet(channels=16, depths=(2, 2), image_size=8, dropout=0.1, batch_size=4)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                             num_sanity_val_steps=0, callbacks=callbacks,
                             default_root_dir=tmp_path)  # ckpt=auto writes its ckpt_plan.json there
        trainer.fit(model, datamodule=ImageData(image_size=8, batch_size=4, num_samples=32, seed=3))
        return model

    seen = Seen()
    planned = fit([ActivationCheckpointing(mode="auto", layers=["Bottleneck", "re:stem"], budget=0.5), seen])
    plain = fit([])
    assert len(seen.groups) == 3 and all(g == seen.groups[0] and g for g in seen.groups)
    assert not any(isinstance(m, OpGroup) or "forward" in m.__dict__ for m in planned.modules())
    final, reference = planned.state_dict(), plain.state_dict()
    assert list(final) == list(reference) and all(torch.equal(final[k], reference[k]) for k in reference)

"""Gradients by any route, and recomputations that do not reproduce their forward.

Non-reentrant checkpointing recomputes inside autograd's unpack hooks, so
``torch.autograd.grad``, ``inputs=`` subsets, a second backward with
``retain_graph=True`` and double backward (``create_graph=True``, a gradient
penalty) all go through it. Each test runs the same float64 step with and
without the plugin (same weights, data and dropout masks) and asserts bitwise
equality, and counts calls of each wrapped block's first child to show the
recomputation really ran.

Then the determinism check (``ckpt_plugin/recompute_check.py``). By default a
wrapped call is torch's plain checkpoint, nothing of ours per saved tensor, and
torch's own check raises its ``CheckpointError``. Inside
``checking_recomputation()`` or with ``ckpt.check_recompute=true``, a wrapped
module whose recomputation saves tensors of another shape, or fewer or more
tensors, is reported with its qualified name and class; one that only changes
values gives a wrong gradient silently (as with torch's own check), unless the
forward runs inside ``checking_recomputed_values()``.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint, set_checkpoint_early_stop

from ckpt_plugin import apply_checkpointing, make_config
from ckpt_plugin._compat import saved_tensors_hooks_depth
from ckpt_plugin.apply.treatment import treatment_of
from ckpt_plugin.engine.recompute_check import (
    RecomputationMismatch,
    checking_recomputation,
    checking_recomputed_values,
)

MODELS = {"gpt": "TransformerBlock", "resnet": "Bottleneck"}
MODES = {
    "full": {},
    "selective": {"mode": "selective"},  # policy matmuls
}
CASES = [(kind, mode) for kind in MODELS for mode in MODES] + [("gpt", "names")]
NAMES = {"mode": "selective", "policy": "names", "save_names": ["attn_out"]}


def build(kind: str, mode: str | None):
    """A float64 example model and batch; wrapped with ``mode`` unless it is None."""
    model = small_gpt(torch.float64, n_layer=2) if kind == "gpt" else small_resnet(torch.float64, depths=(1, 1))
    batch = gpt_batch(model) if kind == "gpt" else resnet_batch(model, dtype=torch.float64)
    wrapped = []
    if mode is not None:
        keys = NAMES if mode == "names" else MODES[mode]
        wrapped = apply_checkpointing(model, layers=MODELS[kind], **keys)
        assert wrapped, "nothing wrapped: the comparison would prove nothing"
    return model, batch, wrapped


@pytest.fixture(scope="module")
def plain_runs() -> dict:
    return {}


def plain(runs: dict, test, kind: str, run):
    """``run(None)``, the step without the plugin, once per test and model kind (shared by the modes)."""
    key = (test.__name__, kind)
    if key not in runs:
        runs[key] = run(None)
    return runs[key]


def first_child_calls(model: nn.Module, names: list[str]) -> dict[str, list[int]]:
    """One counter per wrapped module, bumped by its first child: once per forward and per recompute."""
    modules = dict(model.named_modules())
    counts = {}
    for name in names:
        counts[name] = box = [0]
        child = next(iter(modules[name].children()))
        child.register_forward_pre_hook(lambda *_, box=box: box.__setitem__(0, box[0] + 1))
    return counts


def assert_bitwise(expected, got) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"item {i}: {a} vs {b}"
        else:
            assert torch.equal(a, b), f"item {i} differs: max |diff| {(a - b).abs().max()}"


# --------------------------------------------------------------------------- torch.autograd.grad


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_autograd_grad_equals_plain(plain_runs: dict, kind: str, mode: str) -> None:
    def grads(mode):
        model, batch, wrapped = build(kind, mode)
        calls = first_child_calls(model, wrapped)
        torch.manual_seed(5)
        loss = model.loss(batch)
        g = torch.autograd.grad(loss, list(model.parameters()))
        assert all(p.grad is None for p in model.parameters()), "autograd.grad must not accumulate .grad"
        return [loss.detach(), *g], calls

    got, calls = grads(mode)
    assert_bitwise(plain(plain_runs, test_autograd_grad_equals_plain, kind, grads)[0], got)
    assert all(c == [2] for c in calls.values()), calls  # forward + one recomputation each


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_inputs_subset_equals_plain(plain_runs: dict, kind: str, mode: str) -> None:
    """``autograd.grad`` for a subset of parameters plus the model's input, and ``backward(inputs=...)``."""

    def grads(mode):
        model, batch, _ = build(kind, mode)
        first = dict(model.named_modules())["blocks.0" if kind == "gpt" else "stages.0.0"]
        subset = list(first.parameters())
        if kind == "gpt":
            x = model.tok_emb.weight  # the tokens are integers: take the embedding table instead
            inputs = [x, *subset]
        else:
            x = batch[0].clone().requires_grad_(True)  # gradient w.r.t. the image (saliency)
            batch = (x, batch[1])
            inputs = [x, *subset]
        torch.manual_seed(5)
        g = torch.autograd.grad(model.loss(batch), inputs)
        torch.manual_seed(5)
        model.loss(batch).backward(inputs=subset)
        others = [p.grad for p in model.parameters() if all(p is not q for q in subset)]
        assert all(o is None for o in others), "backward(inputs=...) filled a gradient outside inputs"
        return [*g, *(p.grad for p in subset)]

    assert_bitwise(plain(plain_runs, test_inputs_subset_equals_plain, kind, grads), grads(mode))


# --------------------------------------------------------------------------- second and double backward


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_second_backward_with_retain_graph_equals_plain(plain_runs: dict, kind: str, mode: str) -> None:
    def twice(mode):
        model, batch, wrapped = build(kind, mode)
        calls = first_child_calls(model, wrapped)
        torch.manual_seed(5)
        loss = model.loss(batch)
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad for p in model.parameters()], calls

    got, calls = twice(mode)
    assert_bitwise(plain(plain_runs, test_second_backward_with_retain_graph_equals_plain, kind, twice)[0], got)
    assert all(c == [3] for c in calls.values()), calls  # forward + one recomputation per backward


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_double_backward_gradient_penalty_equals_plain(plain_runs: dict, kind: str, mode: str) -> None:
    """loss + |d loss / d params|^2: the second backward differentiates through the first."""

    def penalised(mode):
        model, batch, wrapped = build(kind, mode)
        calls = first_child_calls(model, wrapped)
        params = list(model.parameters())
        torch.manual_seed(5)
        loss = model.loss(batch)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        (loss + penalty).backward()
        buffers = [b.clone() for b in model.buffers()]  # BatchNorm statistics: one update per forward
        return [loss.detach(), penalty.detach(), *(p.grad for p in params), *buffers], calls

    got, calls = penalised(mode)
    assert_bitwise(plain(plain_runs, test_double_backward_gradient_penalty_equals_plain, kind, penalised)[0], got)
    # forward, the recomputation for autograd.grad, and another for the backward through it
    assert all(c == [3] for c in calls.values()), calls


# --------------------------------------------------------------------------- recomputation changes


class Flaky(nn.Module):
    """``tanh(W x)`` then ``sin``, except that the ``change_on``-th call does something else."""

    def __init__(self, change: str, change_on: int = 2) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.change, self.change_on, self.calls = change, change_on, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.lin(x))
        if self.calls == self.change_on:
            if self.change == "shape":
                h = h[:, :4]
            elif self.change == "fewer":
                return h.sum(-1)
            elif self.change == "more":
                h = torch.sin(h)
            elif self.change == "values":
                h = h * 2
        return torch.sin(h).sum(-1)


class Net(nn.Module):
    def __init__(self, change: str) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.body = nn.Sequential(nn.Identity(), Flaky(change))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.pre(x))


def flaky_step(change: str, wrap: bool = True, **keys: object) -> list[torch.Tensor]:
    """One step of ``Net(change)``, its ``Flaky`` wrapped with the ckpt ``keys`` unless ``wrap`` is false."""
    torch.manual_seed(0)
    net = Net(change)
    if wrap:
        assert apply_checkpointing(net, layers="Flaky", **keys) == ["body.1"]
    net(torch.randn(3, 8)).sum().backward()
    return [p.grad for p in net.parameters()]


ADVICE = (
    "Checkpointing runs a module's forward again in backward and needs the same computation both "
    "times: its forward must depend only on its inputs, parameters and buffers, not on a counter, "
    "a flag or a global changed in between (nor on random numbers, unless ckpt.preserve_rng_state=true). "
    "Make the forward deterministic, or leave the module out of ckpt.layers."
)


def raises_exactly(message: str):
    return pytest.raises(RecomputationMismatch, match=f"^{re.escape(message)}$")


SHAPE_MISMATCH = (
    "body.1 (Flaky) computed something else when recomputed for backward: tensor 4 of the 4 it saved "
    "for backward (output of Tanh) was float32[3, 8] on cpu in the forward and float32[3, 4] on cpu "
    f"in the recomputation. {ADVICE}"
)


def hook_depths(wrap: str, **keys: object) -> list[int]:
    """Saved-tensor hooks in force when ``Flaky``'s first op runs, in the forward and in the recomputation.

    ``wrap``: ``"hand"`` for a hand-written ``checkpoint(flaky, x, use_reentrant=False)``,
    ``"plugin"`` for ``apply_checkpointing`` with ``keys``.
    """
    torch.manual_seed(0)
    flaky = Flaky("none")
    depths: list[int] = []
    flaky.lin.register_forward_pre_hook(lambda *_: depths.append(saved_tensors_hooks_depth()))
    x = torch.randn(3, 8, requires_grad=True)
    if wrap == "hand":
        out = checkpoint(flaky, x, use_reentrant=False)
    else:
        assert apply_checkpointing(nn.Sequential(flaky), layers="Flaky", **keys) == ["0"]
        out = flaky(x)
    out.sum().backward()
    return depths


def test_by_default_a_wrapped_call_is_a_hand_written_checkpoint() -> None:
    """Nothing of ours runs per saved tensor by default: torch's hook is the only one, as by hand
    (issue #12: the per-tensor check was most of the plugin's overhead); checked, ours is under it."""
    assert hook_depths("hand") == [1, 1]  # torch's pack hook in the forward, its recomputation hook
    assert hook_depths("plugin") == [1, 1]
    assert hook_depths("plugin", check_recompute=True) == [2, 2]
    with checking_recomputation():
        assert hook_depths("plugin") == [2, 2]


def test_by_default_torchs_own_check_still_raises() -> None:
    """torch's ``determinism_check="default"`` stays on: a shape change or fewer tensors is its
    CheckpointError (without the module's name), never a silently wrong gradient."""
    with pytest.raises(CheckpointError, match="Recomputed values for the following tensors have different "
                       "metadata than during the forward pass") as info:
        flaky_step("shape")
    assert not isinstance(info.value, RecomputationMismatch)
    with pytest.raises(CheckpointError, match="A different number of tensors was saved during the original "
                       "forward and recomputation") as info:
        flaky_step("fewer")
    assert not isinstance(info.value, RecomputationMismatch)


def test_shape_change_names_the_module_and_the_tensor() -> None:
    # Saved, in order: lin's input, lin's weight (transposed), tanh's output, sin's input (tanh's
    # output again in the forward, a slice of it in the recomputation).
    with checking_recomputation(), raises_exactly(SHAPE_MISMATCH):
        flaky_step("shape")


def test_check_recompute_key_names_the_module() -> None:
    """``ckpt.check_recompute=true`` checks every call, no context manager needed."""
    assert make_config(layers="Flaky", check_recompute=True).check_recompute is True
    assert treatment_of(make_config(layers="Flaky", mode="selective", check_recompute=True)).check_recompute
    assert not treatment_of(make_config(layers="Flaky")).check_recompute  # off by default
    with raises_exactly(SHAPE_MISMATCH):
        flaky_step("shape", check_recompute=True)


@pytest.mark.parametrize(("keys", "message"), [
    ({"check_recompute": "yes"}, "ckpt.check_recompute='yes' (str) must be true or false"),
    ({"check_recompute": True, "segments": 2},
     "ckpt.check_recompute=true cannot be combined with ckpt.segments=2: it names the one module a checkpoint "
     "wraps, and a segment wraps several (torch's own check still runs); drop one of the two"),
    ({"check_recompute": True, "deepspeed": {}},
     "ckpt.check_recompute=true cannot be combined with ckpt.deepspeed (DeepSpeed's own checkpoint): "
     "DeepSpeed's (reentrant) checkpoint has no place for the check"),
])
def test_check_recompute_key_is_validated(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_config(layers="Flaky", **keys)


def test_checking_is_scoped_to_the_forward_run_inside() -> None:
    """Read when a wrapped call starts: a forward outside the context manager is torch's plain checkpoint."""
    with checking_recomputation():
        pass
    with pytest.raises(CheckpointError) as info:
        flaky_step("shape")
    assert not isinstance(info.value, RecomputationMismatch)


def test_the_mismatch_is_a_checkpoint_error() -> None:
    """Code that catches torch's CheckpointError still catches ours."""
    with checking_recomputation(), pytest.raises(CheckpointError):
        flaky_step("shape")


def test_fewer_saved_tensors_names_the_module() -> None:
    with checking_recomputation(), raises_exactly(
        "body.1 (Flaky) computed something else when recomputed for backward: its forward saved 4 tensors "
        f"for backward and its recomputation only 3. {ADVICE}"
    ):
        flaky_step("fewer")


def test_more_saved_tensors_names_the_module() -> None:
    # torch stops a recomputation once it has as many tensors as the forward (early stop),
    # so "more" shows only with early stop off.
    with checking_recomputation(), set_checkpoint_early_stop(False), raises_exactly(
        "body.1 (Flaky) computed something else when recomputed for backward: its recomputation saved "
        f"more tensors for backward than the 4 its forward saved. {ADVICE}"
    ):
        flaky_step("more")


@pytest.mark.parametrize("check", [False, True])
def test_value_change_is_silent_by_default_like_torch(check: bool) -> None:
    """Only shape, dtype and device are checked, by torch or by name: the gradient is wrong, with no error."""
    expected = flaky_step("none", wrap=False)
    wrong = flaky_step("values", check_recompute=check)
    assert not all(torch.equal(a, b) for a, b in zip(expected, wrong, strict=True))


def test_value_change_is_caught_when_checking_values() -> None:
    with checking_recomputed_values(), raises_exactly(
        "body.1 (Flaky) computed something else when recomputed for backward: tensor 4 of the 4 it saved "
        "for backward (output of Tanh, float32[3, 8] on cpu) has other values in the recomputation: "
        f"24 of 24 elements differ. {ADVICE}"
    ):
        flaky_step("values")


def test_checking_values_catches_dropout_without_rng_replay() -> None:
    """The real case: preserve_rng_state=false redraws dropout masks; the last block recomputes first."""
    model = small_gpt(torch.float64, n_layer=2)
    apply_checkpointing(model, layers="TransformerBlock", preserve_rng_state=False)
    with checking_recomputed_values():
        loss = model.loss(gpt_batch(model))
    with pytest.raises(RecomputationMismatch, match=r"^blocks\.1 \(TransformerBlock\) computed something else "
                       r"when recomputed for backward: tensor \d+ of the \d+ it saved for backward \(.*\) has "
                       r"other values in the recomputation: \d+ of \d+ elements differ\. "):
        loss.backward()


@pytest.mark.parametrize("checking", [checking_recomputation, checking_recomputed_values])
@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_checking_passes_a_faithful_recomputation(plain_runs: dict, kind: str, mode: str, checking) -> None:
    """No false alarm (dropout on, RNG replayed, BatchNorm), and the gradients stay bitwise equal."""

    def grads(mode, check):
        model, batch, _ = build(kind, mode)
        torch.manual_seed(5)
        with checking() if check else torch.enable_grad():
            loss = model.loss(batch)
        loss.backward()
        return [p.grad for p in model.parameters()]

    reference = plain(plain_runs, test_checking_passes_a_faithful_recomputation, kind, lambda _: grads(None, False))
    assert_bitwise(reference, grads(mode, True))


def test_torchs_debug_mode_takes_over_the_check() -> None:
    """``set_checkpoint_debug_enabled(True)`` refuses a context_fn: the plugin steps aside and
    torch's debug report (every op of both runs) is raised instead of ours."""
    from torch.utils.checkpoint import set_checkpoint_debug_enabled

    with set_checkpoint_debug_enabled(True), pytest.raises(CheckpointError) as info:
        flaky_step("shape", check_recompute=True)
    assert not isinstance(info.value, RecomputationMismatch)
    assert "Operations executed during recomputation" in str(info.value)

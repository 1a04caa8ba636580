"""Checkpointing must not change what training computes.

Every test compares a run with the plugin against the very same run without
it (same weights, same seeds, same data) and asserts the strongest equality
that holds: on CPU, recomputation replays the same kernels in the same order
with the same RNG state, so losses, gradients, parameters and BatchNorm
statistics are *bitwise* equal (``torch.equal``) in float64, float32 and
under bfloat16 autocast alike.

Each test also checks that the plugin really did something (modules wrapped,
forward recomputed during backward), so an equality can never hold because
checkpointing was silently off. ``test_preserve_rng_state_false_*`` shows
that the comparison is able to fail.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator

import lightning.pytorch as pl
import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_plugin import ActivationCheckpointing, apply_checkpointing, wrapped_modules
from ckpt_examples.data import ImageData, TextData
from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet, ResStage

# --------------------------------------------------------------------------- helpers

BN_STATS = ("running_mean", "running_var", "num_batches_tracked")

# (model kind, ckpt.layers, the qualified names that must get wrapped)
CASES = [
    ("gpt", "TransformerBlock", ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
    ("resnet", "ResStage", ["stages.0", "stages.1"]),
    ("resnet", "Bottleneck", ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]),
]
CASE_IDS = [f"{kind}-{layers}" for kind, layers, _ in CASES]


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    """Trainer(deterministic=True) and seed_everything change process-wide state: put it back."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")}
    dtype = torch.get_default_dtype()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_default_dtype(dtype)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def build(kind: str, dtype: torch.dtype = torch.float64, **overrides) -> pl.LightningModule:
    return (small_gpt if kind == "gpt" else small_resnet)(dtype, **overrides)


def batch_for(kind: str, model: pl.LightningModule, dtype: torch.dtype):
    return gpt_batch(model) if kind == "gpt" else resnet_batch(model, dtype=dtype)


def count_calls(model: nn.Module, names: list[str]) -> dict[str, int]:
    """Count calls of the first child of each named module: it runs once per forward *and* once per recompute.

    (The wrapped module's own forward hooks fire only once: recomputation calls
    its forward directly, but its children are called through ``__call__``.)
    """
    counts = dict.fromkeys(names, 0)
    modules = dict(model.named_modules())
    for name in names:
        child = next(iter(modules[name].children()))

        def hook(*_: object, name: str = name) -> None:
            counts[name] += 1

        child.register_forward_hook(hook)
    return counts


def forward_backward(model: pl.LightningModule, batch, seed: int = 1234) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training-mode forward and backward; the loss and every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model.loss(batch)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad.detach().clone()
    return loss.detach(), grads


def bn_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{m_name}.{s}": getattr(m, s).detach().clone()
        for m_name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for s in BN_STATS
    }


def assert_all_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    assert a, f"no {what} to compare"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what} not bitwise equal: {differ[:8]}" + (
        f" (max abs diff {max((a[k].double() - b[k].double()).abs().max().item() for k in differ):.3e})"
        if all(a[k].is_floating_point() for k in differ)
        else ""
    )


def plain_vs_checkpointed(
    kind: str, layers: str, expected: list[str], dtype: torch.dtype, **ckpt_keys
) -> tuple[tuple, tuple, tuple[dict, dict]]:
    """Two identical models, one wrapped; one forward+backward of each with the same seed."""
    plain, ckpt = build(kind, dtype), build(kind, dtype)
    assert_all_equal(plain.state_dict(), ckpt.state_dict(), "initial weights")
    assert apply_checkpointing(ckpt, layers=layers, **ckpt_keys) == expected
    assert wrapped_modules(ckpt) == expected and wrapped_modules(plain) == []
    batch = batch_for(kind, plain, dtype)
    calls_plain, calls_ckpt = count_calls(plain, expected), count_calls(ckpt, expected)
    a = forward_backward(plain, batch)
    b = forward_backward(ckpt, batch)
    # The plugin was really on: every wrapped module ran its forward again in backward.
    assert calls_plain == dict.fromkeys(expected, 1)
    assert calls_ckpt == dict.fromkeys(expected, 2), calls_ckpt
    return a, b, (bn_stats(plain), bn_stats(ckpt))


# --------------------------------------------------------------------------- 1, 2: one step, eager


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES, ids=CASE_IDS)
def test_float64_loss_and_every_grad_bitwise_equal(kind: str, layers: str, expected: list[str]) -> None:
    (loss_a, grads_a), (loss_b, grads_b), (bn_a, bn_b) = plain_vs_checkpointed(kind, layers, expected, torch.float64)
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    assert_all_equal(grads_a, grads_b, "gradients")
    assert any(g.abs().sum() > 0 for g in grads_a.values())
    if kind == "resnet":  # one forward in train mode: the recompute must not count twice
        assert_all_equal(bn_a, bn_b, "BatchNorm running stats")
        assert all(v.item() == 1 for k, v in bn_b.items() if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES, ids=CASE_IDS)
def test_float32_loss_and_every_grad_bitwise_equal(kind: str, layers: str, expected: list[str]) -> None:
    # Bitwise holds in float32 too (same CPU kernels, same order, same RNG): assert that,
    # which is stronger than assert_close(atol=1e-6, rtol=1e-6).
    (loss_a, grads_a), (loss_b, grads_b), (bn_a, bn_b) = plain_vs_checkpointed(kind, layers, expected, torch.float32)
    assert loss_a.dtype == torch.float32
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    assert_all_equal(grads_a, grads_b, "gradients")
    if kind == "resnet":
        assert_all_equal(bn_a, bn_b, "BatchNorm running stats")


# --------------------------------------------------------------------------- 3: the comparison can fail


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES[:2], ids=CASE_IDS[:2])
def test_preserve_rng_state_false_with_dropout_changes_grads(kind: str, layers: str, expected: list[str]) -> None:
    """Without RNG replay the recompute draws new dropout masks: gradients go wrong.

    This is what tests 1 and 2 would catch if the plugin stopped replaying RNG.
    """
    (loss_a, grads_a), (loss_b, grads_b), _ = plain_vs_checkpointed(
        kind, layers, expected, torch.float64, preserve_rng_state=False
    )
    assert torch.equal(loss_a, loss_b)  # the forward itself is untouched
    differ = [k for k in grads_a if not torch.equal(grads_a[k], grads_b[k])]
    assert differ, "preserve_rng_state=False with dropout on should change the gradients"
    # And not by rounding: the wrong masks change gradients substantially.
    worst = max((grads_a[k] - grads_b[k]).abs().max() / grads_a[k].abs().max().clamp_min(1e-30) for k in differ)
    assert worst > 1e-3


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES[:2], ids=CASE_IDS[:2])
def test_preserve_rng_state_false_without_dropout_is_equal_again(kind: str, layers: str, expected: list[str]) -> None:
    plain, ckpt = build(kind, torch.float64, dropout=0.0), build(kind, torch.float64, dropout=0.0)
    assert apply_checkpointing(ckpt, layers=layers, preserve_rng_state=False) == expected
    batch = batch_for(kind, plain, torch.float64)
    calls = count_calls(ckpt, expected)
    loss_a, grads_a = forward_backward(plain, batch)
    loss_b, grads_b = forward_backward(ckpt, batch)
    assert calls == dict.fromkeys(expected, 2)
    assert torch.equal(loss_a, loss_b)
    assert_all_equal(grads_a, grads_b, "gradients")


# --------------------------------------------------------------------------- Trainer runs


class Recorder(pl.Callback):
    """Placed after ActivationCheckpointing: what is wrapped while batches run."""

    def __init__(self) -> None:
        self.wrapped: list[list[str]] = []
        self.had_blocks_at_setup: bool | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.had_blocks_at_setup = hasattr(pl_module, "blocks")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.wrapped.append(wrapped_modules(pl_module))


def datamodule(kind: str, model: pl.LightningModule) -> pl.LightningDataModule:
    h = model.hparams
    if kind == "gpt":
        return TextData(block_size=h.block_size, batch_size=2, num_samples=16)
    return ImageData(image_size=h.image_size, batch_size=4, num_samples=32, seed=3)


def fit(
    make_model: Callable[[], pl.LightningModule],
    kind: str,
    layers: str | None,
    *,
    precision: str = "64-true",
    max_steps: int = 3,
    accumulate_grad_batches: int = 1,
) -> tuple[pl.LightningModule, Recorder, ActivationCheckpointing | None]:
    """``seed_everything(0)``, build the model, fit; with the callback when ``layers`` is given."""
    pl.seed_everything(0, verbose=False)
    model = make_model()
    callback = ActivationCheckpointing(layers=layers) if layers else None
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate_grad_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
        callbacks=[c for c in (callback, recorder) if c is not None],
    )
    trainer.fit(model, datamodule=datamodule(kind, model))
    assert trainer.global_step == max_steps
    assert len(recorder.wrapped) == max_steps * accumulate_grad_batches
    return model, recorder, callback


def make(kind: str, dtype: torch.dtype = torch.float32, **overrides) -> Callable[[], pl.LightningModule]:
    def make_model() -> pl.LightningModule:
        return (GPT if kind == "gpt" else ResNet)(**_SMALL[kind] | overrides)

    return make_model


# The same sizes as conftest.small_gpt / small_resnet, but built after seed_everything.
_SMALL = {
    "gpt": dict(n_layer=4, n_embd=32, n_head=2, block_size=16, dropout=0.1, batch_size=2),
    "resnet": dict(channels=16, depths=(2, 2), image_size=8, dropout=0.1, batch_size=4),
}


def check_fit(
    kind: str, layers: str, expected: list[str], dtype: torch.dtype = torch.float64, **fit_kwargs
) -> tuple[pl.LightningModule, pl.LightningModule]:
    plain, rec_plain, _ = fit(make(kind, dtype), kind, None, **fit_kwargs)
    ckpt, rec_ckpt, callback = fit(make(kind, dtype), kind, layers, **fit_kwargs)
    # The plugin was on for every batch, and teardown took it off again.
    assert callback.wrapped == expected
    assert all(w == expected for w in rec_ckpt.wrapped), rec_ckpt.wrapped
    assert all(w == [] for w in rec_plain.wrapped)
    assert wrapped_modules(ckpt) == []
    assert all("forward" not in m.__dict__ for m in ckpt.modules())
    # Training changed the weights (so equal weights mean equal updates), identically.
    pl.seed_everything(0, verbose=False)
    initial = make(kind, dtype)().to(plain.dtype).state_dict()
    final = plain.state_dict()
    assert all(not torch.equal(initial[k], final[k]) for k in ("stem.0.weight", "fc.weight", "head.weight") if k in final)
    assert_all_equal(final, ckpt.state_dict(), "final state_dict")
    return plain, ckpt


# --------------------------------------------------------------------------- 4: Trainer, 64-true


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES[:2], ids=CASE_IDS[:2])
def test_trainer_float64_final_params_bitwise_equal_and_unwrapped(kind: str, layers: str, expected: list[str]) -> None:
    plain, ckpt = check_fit(kind, layers, expected)
    assert next(ckpt.parameters()).dtype == torch.float64


# --------------------------------------------------------------------------- 5: BatchNorm


@pytest.mark.parametrize("layers", ["ResStage", "Bottleneck"])
def test_trainer_batchnorm_running_stats_bitwise_equal(layers: str) -> None:
    expected = next(e for k, l, e in CASES if k == "resnet" and l == layers)
    plain, ckpt = check_fit("resnet", layers, expected)
    a, b = bn_stats(plain), bn_stats(ckpt)
    assert len(a) == 3 * 14  # 1 stem BN + 4 blocks x 3 BN + 1 downsample shortcut BN = 14 BN layers
    assert_all_equal(a, b, "BatchNorm running stats")
    # Three training batches: each BN counted three times, not six.
    assert all(v.item() == 3 for k, v in b.items() if k.endswith("num_batches_tracked"))


def test_upstream_checkpoint_double_counts_batchnorm_and_plugin_does_not() -> None:
    """pytorch#96136: plain non-reentrant checkpoint of a BN block updates its running stats twice."""
    torch.manual_seed(0)
    base = ResStage(16, depth=2, stride=2, dropout=0.1).double().train()
    plain, upstream, ours = copy.deepcopy(base), copy.deepcopy(base), nn.Sequential(copy.deepcopy(base)).train()
    assert apply_checkpointing(ours, layers="ResStage") == ["0"]
    x = torch.randn(4, 16, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(7)
        xi = x.clone().requires_grad_()
        fn(xi).square().sum().backward()
        return xi.grad

    g_plain = run(plain)
    g_upstream = run(lambda t: checkpoint(upstream, t, use_reentrant=False))
    g_ours = run(ours)
    s_plain, s_upstream, s_ours = bn_stats(plain), bn_stats(upstream), {
        k.removeprefix("0."): v for k, v in bn_stats(ours).items()
    }
    # Upstream: gradients are right, but every BN counted the batch twice and moved its stats twice.
    assert torch.equal(g_plain, g_upstream)
    assert all(v.item() == 1 for k, v in s_plain.items() if k.endswith("num_batches_tracked"))
    assert all(v.item() == 2 for k, v in s_upstream.items() if k.endswith("num_batches_tracked"))
    assert not torch.equal(s_plain["0.bn1.running_mean"], s_upstream["0.bn1.running_mean"])
    assert not torch.equal(s_plain["0.bn1.running_var"], s_upstream["0.bn1.running_var"])
    # Ours: everything as without checkpointing.
    assert torch.equal(g_plain, g_ours)
    assert_all_equal(s_plain, s_ours, "BatchNorm running stats")


# --------------------------------------------------------------------------- 6: autocast


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES[:2], ids=CASE_IDS[:2])
def test_bf16_autocast_loss_and_grads_bitwise_equal(kind: str, layers: str, expected: list[str]) -> None:
    # The non-reentrant checkpoint records the autocast state of the forward and recomputes
    # under the same one, so the same bf16 kernels run again: bitwise equality holds.
    plain, ckpt = build(kind, torch.float32), build(kind, torch.float32)
    assert apply_checkpointing(ckpt, layers=layers) == expected
    batch = batch_for(kind, plain, torch.float32)
    calls = count_calls(ckpt, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            assert plain(batch[0]).dtype == torch.bfloat16  # autocast really is on
        loss_a, grads_a = forward_backward(plain, batch)
        loss_b, grads_b = forward_backward(ckpt, batch)
    assert calls == dict.fromkeys(expected, 2)
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    assert_all_equal(grads_a, grads_b, "gradients")


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES[:2], ids=CASE_IDS[:2])
def test_trainer_bf16_mixed_final_params_bitwise_equal(kind: str, layers: str, expected: list[str]) -> None:
    plain, ckpt = check_fit(kind, layers, expected, dtype=torch.float32, precision="bf16-mixed", max_steps=2)
    assert next(ckpt.parameters()).dtype == torch.float32


# --------------------------------------------------------------------------- 7: gradient accumulation


@pytest.mark.parametrize(("kind", "layers", "expected"), CASES[:2], ids=CASE_IDS[:2])
def test_trainer_gradient_accumulation_final_params_bitwise_equal(kind: str, layers: str, expected: list[str]) -> None:
    check_fit(kind, layers, expected, max_steps=2, accumulate_grad_batches=2)  # 4 batches, 2 optimizer steps


# --------------------------------------------------------------------------- 8: configure_model


def test_layers_built_in_configure_model_are_wrapped_and_train_identically() -> None:
    expected = CASES[0][2]
    unbuilt = make("gpt", defer_init=True)()
    assert not hasattr(unbuilt, "blocks")
    plain, rec_plain, _ = fit(make("gpt", torch.float64, defer_init=True), "gpt", None)
    ckpt, rec_ckpt, callback = fit(make("gpt", torch.float64, defer_init=True), "gpt", "TransformerBlock")
    # configure_model ran after the callbacks' setup, and the callback still found the blocks.
    assert rec_ckpt.had_blocks_at_setup is False
    assert callback.wrapped == expected
    assert rec_ckpt.wrapped == [expected] * 3
    assert rec_plain.wrapped == [[]] * 3
    assert wrapped_modules(ckpt) == []
    assert_all_equal(plain.state_dict(), ckpt.state_dict(), "final state_dict")


def test_configure_model_grads_bitwise_equal() -> None:
    """Eager check of the same: layers built by configure_model, wrapped afterwards, grads as without."""
    plain, ckpt = small_gpt(torch.float64, defer_init=True), small_gpt(torch.float64, defer_init=True)
    for m in (plain, ckpt):
        assert not hasattr(m, "blocks")
        torch.manual_seed(5)
        m.configure_model()
        m.double()
    assert_all_equal(plain.state_dict(), ckpt.state_dict(), "weights")
    assert apply_checkpointing(ckpt, layers="TransformerBlock") == CASES[0][2]
    batch = gpt_batch(plain)
    (loss_a, grads_a), (loss_b, grads_b) = forward_backward(plain, batch), forward_backward(ckpt, batch)
    assert torch.equal(loss_a, loss_b)
    assert_all_equal(grads_a, grads_b, "gradients")


# --------------------------------------------------------------------------- precision and failures


def test_report_converts_example_input_like_a_batch_under_64_true() -> None:
    """The report's forward gets ``example_input_array`` as the loop gets a batch: through
    ``precision_plugin.convert_input``. A float32 example must not crash a float64 ResNet."""
    kwargs = dict(max_steps=1)
    plain, _, _ = fit(make("resnet", torch.float32), "resnet", None, **kwargs)  # float32 example: works without us
    assert next(plain.parameters()).dtype == torch.float64
    ckpt, _, callback = fit(make("resnet", torch.float32), "resnet", "ResStage", **kwargs)
    assert_all_equal(plain.state_dict(), ckpt.state_dict(), "final state_dict")


def test_a_failing_fit_leaves_the_model_unwrapped() -> None:
    """Lightning skips ``teardown`` when fit raises; ``on_exception`` unwraps instead."""

    class Boom(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            raise RuntimeError("boom")

    model = make("gpt")()
    callback = ActivationCheckpointing(layers="TransformerBlock")
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Boom()],
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, datamodule=datamodule("gpt", model))
    assert callback.wrapped == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert wrapped_modules(model) == []


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_deep_copy_of_a_wrapped_model_trains_as_the_original(mode: str) -> None:
    """``copy.deepcopy`` (an EMA, Lightning's StochasticWeightAveraging, torch's AveragedModel) of a
    checkpointed ResNet: the copy is wrapped too, its BatchNorm fix restores the copy's statistics, and a
    step of it is bitwise the original's (gradients and statistics). Before, the copy's checkpoint contexts
    came out of the copy as their compile-cache key and the first step raised."""
    from ckpt_plugin.apply.install import apply_config
    from ckpt_plugin.config.schema import make_config

    model = small_resnet()
    batch = resnet_batch(model)
    apply_config(model, make_config(mode=mode, layers="Bottleneck"))
    twin = copy.deepcopy(model)
    assert wrapped_modules(twin) == wrapped_modules(model)
    runs = []
    for m in (model, twin):
        torch.manual_seed(0)
        m.loss(batch).backward()
        runs.append(([p.grad for p in m.parameters()], [b.clone() for b in m.buffers()]))
    (grads, buffers), (twin_grads, twin_buffers) = runs
    assert all(torch.equal(a, b) for a, b in zip(grads, twin_grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, twin_buffers, strict=True))

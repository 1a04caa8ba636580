"""``ckpt.compile``: each selected layer runs compiled, its checkpoint included (regional compilation).

The reference is always the same layers compiled *without* checkpointing
(``nn.Module.compile(fullgraph=True)`` on each, which keeps the names too), with the
same backend: what a user would have compiled by hand. Against it, with the plugin:

- the example GPT (4 blocks, float32, dropout 0.1 on) in ``full``, ``selective``
  and ``offload`` modes, and ``auto`` on the layers its plan wraps: loss and every
  gradient bitwise equal, one graph for all 4 blocks, no graph break, and (full,
  selective) less kept for backward by the compiled graphs;
- the ResNet with BatchNorm (``Bottleneck``, dropout on): loss, gradients and the
  running statistics bitwise equal;
- ``torch.compile`` of the whole loss over regionally compiled layers (nested):
  one graph, no break, gradients bitwise equal;
- the Lightning callback in a real ``Trainer`` for 2 steps: final weights bitwise
  equal to the same fit with the blocks compiled by hand; the report before the
  first batch compiles nothing (it runs on fake tensors, uncompiled);
- names and ``state_dict`` keys unchanged, ``remove_checkpointing`` leaves no
  compiled call behind, applying twice wraps once and compiles nothing again;
- CPU inductor on a 2-block GPT (dropout on): bitwise equal to the blocks compiled
  with inductor by hand (measured; compile itself differs from eager by up to
  4e-7 relative on these gradients, see the README);
- every refused value and combination, with its exact message, from Python and
  from a composed Hydra config.

``aot_eager`` (dynamo's capture and AOTAutograd's partition, no C++ build) except
for the one inductor test.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from conftest import compiled_backward_bytes, compose_train, gpt_batch, resnet_batch, small_gpt, small_resnet
from hydra.utils import instantiate
from torch import nn
from torch._dynamo.utils import counters

from ckpt_plugin import ActivationCheckpointing, apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin.lightning.app import check_app_config
from ckpt_plugin.engine.wrap import CheckpointedForward, compiled_modules
from ckpt_plugin.errors import ConfigError
from ckpt_examples.data import TextData

BACKEND = "aot_eager"
BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
BOTTLENECKS = ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]
needs_cxx = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="CPU inductor needs a C++ compiler"
)
# Inductor's own C++ build of the GPT's graphs costs ~22 s on 2 cores, a twentieth of the suite: the default
# suite compiles through aot_eager (the same capture and partition) and tests/test_compile_cache.py already
# compiles through inductor; CKPT_INDUCTOR_TESTS=1 runs this case too (README: "Regional compilation").
inductor_opt_in = pytest.mark.skipif(
    os.environ.get("CKPT_INDUCTOR_TESTS") != "1", reason="inductor's C++ build: set CKPT_INDUCTOR_TESTS=1"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test traces anew and counts its own graphs and breaks."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def compile_by_hand(model: nn.Module, names: list[str], backend: str = BACKEND) -> None:
    """The reference: the same layers compiled, without checkpointing."""
    modules = dict(model.named_modules())
    for name in names:
        modules[name].compile(backend=backend, fullgraph=True)


@dataclass
class Step:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    buffers: list[torch.Tensor]
    saved: int  # bytes the compiled graphs keep for backward


def step(model: nn.Module, batch, loss_fn=None) -> Step:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = (loss_fn or model.loss)(batch)
    saved, _ = compiled_backward_bytes(loss, model)
    loss.backward()
    return Step(loss.detach(), [p.grad.clone() for p in model.parameters()],
                [b.clone() for b in model.buffers()], saved)


def assert_bitwise(got: Step, expected: Step) -> None:
    assert torch.equal(got.loss, expected.loss)
    assert all(torch.equal(a, b) for a, b in zip(got.grads, expected.grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.buffers, expected.buffers, strict=True))


def gpt_by_hand(backend: str = BACKEND, **overrides) -> Step:
    model = small_gpt(**overrides)
    compile_by_hand(model, [f"blocks.{i}" for i in range(len(model.blocks))], backend)
    return step(model, gpt_batch(model))


@pytest.fixture(scope="module")
def by_hand() -> Step:
    torch._dynamo.reset()
    return gpt_by_hand()


# --------------------------------------------------------------------------- the torch-level API


@pytest.mark.parametrize("keys", [{}, {"mode": "selective"}, {"mode": "offload"}], ids=["full", "selective", "offload"])
def test_gpt_bitwise_equal_to_the_same_layers_compiled_without_checkpointing(keys: dict, by_hand: Step) -> None:
    model = small_gpt()
    assert apply_checkpointing(model, layers="TransformerBlock", compile=BACKEND, **keys) == BLOCKS
    assert compiled_modules(model) == BLOCKS
    got = step(model, gpt_batch(model))
    assert_bitwise(got, by_hand)
    assert (graphs(), graph_breaks()) == (1, 0)  # one graph serves the 4 blocks
    if keys.get("mode") == "offload":
        assert got.saved == by_hand.saved  # on CPU nothing moves
    else:
        assert got.saved < by_hand.saved  # the compiled backward recomputes


def test_batchnorm_statistics_and_gradients_bitwise() -> None:
    expected = small_resnet()  # dropout 0.1 on
    compile_by_hand(expected, BOTTLENECKS)
    expected = step(expected, resnet_batch(expected))
    model = small_resnet()
    assert apply_checkpointing(model, layers="Bottleneck", compile=BACKEND) == BOTTLENECKS
    got = step(model, resnet_batch(model))
    assert_bitwise(got, expected)  # running_mean, running_var, num_batches_tracked included
    assert got.saved < expected.saved and graph_breaks() == 0


def test_auto_compiles_the_layers_its_plan_wraps() -> None:
    model = small_gpt()
    names = apply_checkpointing(model, mode="auto", layers="TransformerBlock", budget=0.5, compile=BACKEND)
    assert names and compiled_modules(model) == names
    got = step(model, gpt_batch(model))
    torch._dynamo.reset()
    expected = small_gpt()
    compile_by_hand(expected, names)
    expected = step(expected, gpt_batch(expected))
    assert_bitwise(got, expected)
    assert got.saved < expected.saved


def test_torch_compile_of_the_whole_model_over_compiled_layers(by_hand: Step) -> None:
    """Nested: the outer compile inlines the layers' compiled calls into one graph."""
    model = small_gpt()
    apply_checkpointing(model, layers="TransformerBlock", compile=BACKEND)
    got = step(model, gpt_batch(model), torch.compile(model.loss, backend=BACKEND))
    assert (graphs(), graph_breaks()) == (1, 0)
    assert_bitwise(got, by_hand)
    assert got.saved < by_hand.saved


def test_names_stay_and_remove_leaves_no_compiled_call() -> None:
    plain, model = small_gpt(), small_gpt()
    apply_checkpointing(model, layers="TransformerBlock", compile=BACKEND)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    step(model, gpt_batch(model))
    assert remove_checkpointing(model) == BLOCKS
    assert wrapped_modules(model) == [] and compiled_modules(model) == []
    assert all("forward" not in m.__dict__ and m._compiled_call_impl is None for m in model.modules())
    graphs_before = graphs()
    assert_bitwise(step(model, gpt_batch(model)), step(plain, gpt_batch(plain)))  # eager, as never wrapped
    assert graphs() == graphs_before


def test_applying_twice_wraps_once_and_compiles_once(by_hand: Step) -> None:
    model = small_gpt()
    apply_checkpointing(model, layers="TransformerBlock", compile=BACKEND)
    first = step(model, gpt_batch(model))
    apply_checkpointing(model, layers="TransformerBlock", compile=BACKEND)
    wrapper = model.blocks[0].__dict__["forward"]
    assert isinstance(wrapper, CheckpointedForward) and not isinstance(wrapper.inner, CheckpointedForward)
    assert_bitwise(step(model, gpt_batch(model)), first)
    assert graphs() == 1  # the second installation found the first one's graph
    assert_bitwise(first, by_hand)


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * mask


def test_keyword_tensors_are_graph_inputs_not_constants() -> None:
    """Two layers called with different ``mask=`` tensors share one graph and give eager's results."""
    torch.manual_seed(0)
    model = nn.ModuleList([_Masked(), _Masked()])
    x, masks = torch.randn(3, 4, requires_grad=True), torch.rand(2, 3, 4)

    def run() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model[1](model[0](x, mask=masks[0]), mask=masks[1])
        out.sum().backward()
        return [out.detach()] + [p.grad.clone() for p in model.parameters()]

    expected = run()
    apply_checkpointing(model, layers="_Masked", compile=BACKEND)
    assert all(torch.equal(a, b) for a, b in zip(run(), expected, strict=True))
    assert graphs() == 1


@needs_cxx
@inductor_opt_in
def test_inductor_bitwise_equal_to_the_same_layers_compiled_by_hand() -> None:
    expected = gpt_by_hand("inductor", n_layer=2)
    model = small_gpt(n_layer=2)
    apply_checkpointing(model, layers="TransformerBlock", compile=True)
    got = step(model, gpt_batch(model))
    assert_bitwise(got, expected)
    assert got.saved < expected.saved


# --------------------------------------------------------------------------- the Lightning callback


class _GraphsAtTrainStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.graphs = graphs()


def _fit(callback: ActivationCheckpointing | None) -> tuple[pl.LightningModule, _GraphsAtTrainStart]:
    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, verbose=False)
    model = small_gpt()
    if callback is None:
        compile_by_hand(model, BLOCKS)
    seen = _GraphsAtTrainStart()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[c for c in (callback, seen) if c is not None],
    )
    trainer.fit(model, datamodule=TextData(block_size=model.hparams.block_size, batch_size=2, num_samples=8))
    assert trainer.global_step == 2
    return model, seen


def test_callback_in_a_real_trainer_equals_the_fit_with_the_layers_compiled_by_hand() -> None:
    expected, _ = _fit(None)
    callback = ActivationCheckpointing(layers="TransformerBlock", compile=BACKEND)
    model, seen = _fit(callback)
    assert callback.wrapped == BLOCKS
    assert seen.graphs == 0  # the report before the first batch ran uncompiled, on fake tensors
    assert graphs() == 1
    assert callback.report is not None and "counted as the layers run uncompiled" in str(callback.report)
    assert wrapped_modules(model) == [] and all("forward" not in m.__dict__ for m in model.modules())
    expected_state = expected.state_dict()
    assert all(torch.equal(v, expected_state[k]) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- errors


class _Branchy(nn.Module):
    """A layer whose forward branches on a tensor's value: dynamo cannot capture it as one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if y.sum() > 0 else -y


def test_a_layer_that_does_not_compile_whole_is_an_error_naming_it() -> None:
    model = nn.Sequential(_Branchy(), _Branchy())
    apply_checkpointing(model, layers="_Branchy", compile=BACKEND)
    with pytest.raises(ConfigError, match=re.escape(
        "ckpt.compile (aot_eager): 0 (_Branchy) does not compile as one graph with its checkpoint "
        "(torch.compile(fullgraph=True) over its checkpointed forward): "
    )) as info:
        model(torch.randn(2, 4, requires_grad=True))
    assert str(info.value).endswith(
        "; change that part of its forward (TORCH_LOGS=graph_breaks shows where), select layers that compile "
        "whole, or set ckpt.compile=false")
    assert info.value.keys == ["ckpt.compile"]


def test_past_the_recompile_limit_is_an_error_naming_the_layer() -> None:
    """Two graphs per compiled layer (training and eval), or torch's limit if higher; here torch's is 1."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        apply_checkpointing(model, layers="0", compile=BACKEND)
        for batch in (1, 2):  # a new shape, a new graph
            model(torch.randn(batch, 4, requires_grad=True)).sum().backward()
        with pytest.raises(ConfigError, match="^" + re.escape(
            "ckpt.compile (aot_eager): compiling 0 (Linear) once more would pass the recompile limit of the 1 compiled "
            "layer(s), 2 graphs (two per layer, for training and eval, or torch._dynamo.config.recompile_limit if "
            "higher): their input shapes keep changing; mark the changing dimension dynamic "
            "(torch._dynamo.mark_dynamic), raise torch._dynamo.config.recompile_limit before applying, or set "
            "ckpt.compile=false"
        ) + "$"):
            model(torch.randn(3, 4, requires_grad=True))


BACKENDS_FIX = "; give true (inductor), false or a backend name; closest first: 'inductor', "

ERRORS = [
    ({"compile": 1}, "ckpt.compile=1 (int) must be true (inductor), false or the name of a torch.compile backend"),
    ({"compile": None},
     "ckpt.compile=None (NoneType) must be true (inductor), false or the name of a torch.compile backend"),
    ({"compile": "inductr"}, "ckpt.compile='inductr' is not a torch.compile backend" + BACKENDS_FIX),
    ({"compile": "true"}, "ckpt.compile='true' is not a torch.compile backend; give true (inductor), false or a "
                          "backend name; closest first: "),
    ({"compile": True, "segments": 2},
     "ckpt.compile=true cannot be combined with ckpt.segments=2: a segment is one checkpoint over several layers' "
     "calls, opened in the first layer's forward pre-hook and closed in the last one's forward hook, so there is "
     "no one call to compile; drop ckpt.segments (each layer is then its own compiled checkpoint), or drop "
     "ckpt.compile"),
    ({"compile": "aot_eager", "deepspeed": {}},
     "ckpt.compile=aot_eager cannot be combined with ckpt.deepspeed (DeepSpeed's own checkpoint): torch.compile "
     "captures torch's checkpoint as one region, not DeepSpeed's reentrant autograd Function; drop ckpt.compile, "
     "or drop ckpt.deepspeed (ckpt=full: torch's checkpoint, which compiles)"),
    ({"compile": True, "check_recompute": True},
     "ckpt.compile=true cannot be combined with ckpt.check_recompute=true: compiled, a layer's recomputation is "
     "part of its compiled backward graph, not a second run of its forward, so there is nothing to check; drop one "
     "of the two"),
    ({"compile": True, "mode": "selective", "policy": "names", "save_names": ["attn_out"]},
     "ckpt.compile=true cannot be combined with ckpt.policy=names: checkpoint_name tags are emitted only in the "
     "plugin's eager selective modes, which torch.compile replaces by torch's, so no tag would be saved; use "
     "ckpt.policy=matmuls or a list of aten ops (these compile), or drop ckpt.compile"),
]


@pytest.mark.parametrize(("keys", "message"), ERRORS, ids=lambda x: str(x)[:40] if isinstance(x, dict) else "")
def test_refused_values_and_combinations(keys: dict, message: str) -> None:
    model = small_gpt()
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as info:
        apply_checkpointing(model, layers="TransformerBlock", **keys)
    assert info.value.keys == ["ckpt.compile"]
    assert wrapped_modules(model) == []


def test_every_mode_that_wraps_layers_accepts_it_and_none_ignores_it() -> None:
    for keys in ({}, {"mode": "selective"}, {"mode": "offload"}, {"offload": True}, {"preserve_rng_state": False}):
        model = small_gpt()
        assert apply_checkpointing(model, layers="TransformerBlock", compile="eager", **keys) == BLOCKS
        assert compiled_modules(model) == BLOCKS
    assert apply_checkpointing(small_gpt(), mode="none", compile=2) == []


# --------------------------------------------------------------------------- Hydra


def test_the_preset_composes_with_the_key() -> None:
    for override, value in (("ckpt.compile=true", True), ("ckpt.compile=aot_eager", "aot_eager"), (None, False)):
        cfg = compose_train(*[o for o in (override,) if o])
        check_app_config(cfg)
        assert instantiate(cfg.callbacks.activation_checkpointing).config.compile == value
    cfg = compose_train("ckpt=offload", "ckpt.compile=true")
    assert instantiate(cfg.callbacks.activation_checkpointing).config.compile is True


@pytest.mark.parametrize(("overrides", "message"), [
    (["ckpt.compile=2"], "ckpt.compile=2 (int) must be true (inductor), false or the name of a torch.compile backend"),
    (["ckpt.compile=yes"], "ckpt.compile='yes' is not a torch.compile backend; give true (inductor), false or a "
                           "backend name; closest first: "),
    (["ckpt=segments", "ckpt.compile=true"],
     "ckpt.compile=true cannot be combined with ckpt.segments=sqrt: a segment is one checkpoint over several "
     "layers' calls"),
])
def test_a_composed_config_is_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as info:
        check_app_config(compose_train(*overrides))
    assert info.value.keys == ["ckpt.compile"]

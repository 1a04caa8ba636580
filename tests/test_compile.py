"""torch.compile of a model with the plugin applied.

Under ``torch.compile``, dynamo turns each wrapped module's ``checkpoint`` call
into a higher-order op and AOTAutograd's partitioner decides what the compiled
backward keeps: the ops of a checkpointed region are recomputed (``full``) or
saved by the policy (``selective``, torch's own selective-checkpoint modes
deciding with our policy; see ``treatment.py``). What these tests prove, on a
2-block GPT of width 32 in float64 (dropout off where compiled is compared
with eager: inductor draws its own random numbers):

- with CPU inductor (``CKPT_INDUCTOR_TESTS=1``; by default ``full`` runs through
  ``aot_eager`` too), the loss and every gradient equal the eager run with the
  plugin to a relative 1e-13 (measured: 1e-15; inductor fuses, so not
  bitwise), and are *bitwise* equal to the same model compiled without the
  plugin (recomputation under compile replays the same kernels);
- the plugin adds no graph break: one graph for the whole loss, with and
  without it (``counters["graph_break"]``);
- the memory saving survives compilation. Measure: the compiled step's
  backward is one ``CompiledFunctionBackward`` node whose ``saved_tensors``
  are exactly what the compiled graph keeps for backward; we sum their unique
  storages, parameters and buffers left out, as ``measure.saved_bytes`` counts
  eagerly (on this GPT, ``aot_eager`` without the plugin keeps exactly the
  bytes eager autograd keeps). Compiled with the plugin keeps no more than
  eager with it, plus one CPU RNG state per checkpointed region (the compiled
  backward replays the region's random ops from it);
- orders: apply then compile, compile then apply (also on the compiled
  module itself), and compile, run, apply, run, remove, run: dynamo guards on
  each module's ``forward`` and recompiles, so every run keeps what its
  wrapping says (measured) with gradients unchanged;
- BatchNorm (ResNet) under compile: gradients and running statistics bitwise
  equal to the compiled plain model (the partitioner recomputes, it never
  writes a buffer twice); dropout: bitwise equal masks with and without;
- ``policy=names`` under compile is a clear error (tags live in our eager
  modes only).

The order and BatchNorm tests use the ``aot_eager`` backend: the same dynamo
capture and AOTAutograd partition as inductor without the C++ build, which is
what costs the time here (about 30 s per cold inductor compile on 2 cores,
a few seconds from inductor's on-disk cache).
"""

from __future__ import annotations

import os

import re
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo
from conftest import compiled_backward_bytes, gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn
from torch._dynamo.utils import counters

from ckpt_plugin import apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin.measure.memory import saved_bytes
from ckpt_plugin.engine.treatment import NAMES_UNDER_COMPILE

needs_cxx = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="CPU inductor needs a C++ compiler"
)

BLOCKS = ["blocks.0", "blocks.1"]
KEYS = {
    "none": None,
    "full": {"layers": "TransformerBlock"},
    "selective": {"layers": "TransformerBlock", "mode": "selective"},  # policy matmuls
}


def gpt(dropout: float = 0.0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = small_gpt(torch.float64, n_layer=2, dropout=dropout)
    return model, gpt_batch(model)


def compile_fresh(fn, backend: str):
    """``torch.compile(fn)`` with dynamo's in-memory caches and counters emptied, so every
    model is traced anew and its graph breaks are its own."""
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=backend)


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def compiled_saved_bytes(loss: torch.Tensor, model: nn.Module) -> int:
    total, nodes = compiled_backward_bytes(loss, model)
    assert nodes >= 1, "no compiled function behind the loss: nothing was compiled"
    return total


@dataclass
class Run:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    saved: int  # bytes the compiled backward keeps
    breaks: int
    graphs: int
    eager_loss: torch.Tensor | None = None  # the same model and wrapping, uncompiled
    eager_grads: list[torch.Tensor] | None = None
    eager_saved: int | None = None


def step(model: nn.Module, loss_fn, batch, compiled: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One loss and backward: (loss, gradients, compiled backward's saved bytes or None)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = loss_fn(batch)
    saved = compiled_saved_bytes(loss, model) if compiled else None
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], saved


# Each cold inductor compile costs about 25 s on 2 cores, a twentieth of the suite: by default every
# run goes through aot_eager (the same dynamo capture and AOTAutograd partition, no C++ build);
# CKPT_INDUCTOR_TESTS=1 runs full through CPU inductor (the C++ path) as well. The default suite still
# compiles through inductor in tests/test_compile_cache.py, whose job checks its gradients against eager.
INDUCTOR = os.environ.get("CKPT_INDUCTOR_TESTS") == "1"
BACKENDS = {"none": "aot_eager", "full": "inductor" if INDUCTOR else "aot_eager", "selective": "aot_eager"}


@pytest.fixture(scope="module")
def inductor() -> dict[str, Run]:
    """The GPT's loss compiled: full with CPU inductor, without the plugin and selective with aot_eager."""
    runs = {}
    for mode, keys in KEYS.items():
        model, batch = gpt()
        if keys:
            assert apply_checkpointing(model, **keys) == BLOCKS
        compiled = compile_fresh(model.loss, BACKENDS[mode])
        loss, grads, saved = step(model, compiled, batch)
        run = Run(loss, grads, saved, graph_breaks(), counters["stats"]["unique_graphs"])
        run.eager_loss, run.eager_grads, _ = step(model, model.loss, batch, compiled=False)
        run.eager_saved = saved_bytes(model, lambda: model.loss(batch), BLOCKS).total
        runs[mode] = run
    return runs


# --------------------------------------------------------------------------- inductor


@needs_cxx
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_gradients_equal_eager_with_the_plugin(inductor: dict[str, Run], mode: str) -> None:
    run = inductor[mode]
    torch.testing.assert_close(run.loss, run.eager_loss, rtol=1e-13, atol=0.0)
    for compiled, eager in zip(run.grads, run.eager_grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-13, atol=1e-15)


@needs_cxx
@pytest.mark.parametrize("mode", ["selective"])  # the same backend as the run without the plugin
def test_compiled_gradients_bitwise_equal_compiled_without_the_plugin(inductor: dict[str, Run], mode: str) -> None:
    plain, run = inductor["none"], inductor[mode]
    assert torch.equal(plain.loss, run.loss)
    assert all(torch.equal(a, b) for a, b in zip(plain.grads, run.grads, strict=True))


@needs_cxx
@pytest.mark.parametrize("mode", list(KEYS))
def test_one_graph_no_graph_break(inductor: dict[str, Run], mode: str) -> None:
    """The loss compiles to one graph with and without the plugin: the plugin adds no break."""
    assert (inductor[mode].breaks, inductor[mode].graphs) == (0, 1)


@needs_cxx
def test_memory_saving_kept_under_compile(inductor: dict[str, Run]) -> None:
    none, full, selective = (inductor[m] for m in KEYS)
    assert full.saved < selective.saved < none.saved  # selective also keeps the matmul outputs
    # Compiled keeps no more than eager autograd does (measure.saved_bytes, the same count) ...
    assert none.saved <= none.eager_saved
    # ... and with the plugin no more than eager with it, plus what the compiled backward needs
    # to replay a region's random ops: one CPU RNG state (torch.get_rng_state()) per region.
    rng_state = torch.get_rng_state().numel()
    for run in (full, selective):
        assert run.saved <= run.eager_saved + len(BLOCKS) * rng_state


# --------------------------------------------------------------------------- orders (aot_eager)


@pytest.fixture(scope="module")
def aot() -> dict[str, Run]:
    """Apply, then compile, with ``aot_eager``: the reference for the other orders."""
    runs = {}
    for mode in ("none", "full"):
        model, batch = gpt()
        if KEYS[mode]:
            apply_checkpointing(model, **KEYS[mode])
        loss, grads, saved = step(model, compile_fresh(model.loss, "aot_eager"), batch)
        runs[mode] = Run(loss, grads, saved, graph_breaks(), counters["stats"]["unique_graphs"])
    assert runs["full"].saved < runs["none"].saved
    return runs


def assert_same_step(got: tuple, expected: Run) -> None:
    loss, grads, saved = got
    assert saved == expected.saved
    assert torch.equal(loss, expected.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected.grads, strict=True))


def test_compile_then_apply_before_the_first_run(aot: dict[str, Run]) -> None:
    """What Lightning does with ``trainer.fit(torch.compile(model))``: the callback wraps later."""
    model, batch = gpt()
    compiled = compile_fresh(model.loss, "aot_eager")
    apply_checkpointing(model, **KEYS["full"])
    assert_same_step(step(model, compiled, batch), aot["full"])


def test_apply_to_the_compiled_module_itself(aot: dict[str, Run]) -> None:
    """``apply_checkpointing(torch.compile(model))`` wraps the model's modules, under their own names."""
    model, batch = gpt()
    compiled = compile_fresh(model, "aot_eager")
    assert apply_checkpointing(compiled, **KEYS["full"]) == BLOCKS
    assert wrapped_modules(compiled) == wrapped_modules(model) == BLOCKS
    loss_fn = lambda b: nn.functional.cross_entropy(compiled(b[0]).flatten(0, 1), b[1].flatten())  # noqa: E731
    loss, grads, saved = step(model, loss_fn, batch)
    assert torch.equal(loss, aot["full"].loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, aot["full"].grads, strict=True))
    assert saved < aot["none"].saved
    assert remove_checkpointing(compiled) == BLOCKS and wrapped_modules(model) == []


def test_compile_run_apply_run_remove_run_recompiles(aot: dict[str, Run]) -> None:
    model, batch = gpt()
    compiled = compile_fresh(model.loss, "aot_eager")
    assert_same_step(step(model, compiled, batch), aot["none"])
    apply_checkpointing(model, **KEYS["full"])
    assert_same_step(step(model, compiled, batch), aot["full"])
    remove_checkpointing(model)
    assert_same_step(step(model, compiled, batch), aot["none"])
    assert counters["frames"]["ok"] == 2  # traced without, then with; the third run found the first again
    assert graph_breaks() == 0


def test_batchnorm_statistics_and_gradients_under_compile() -> None:
    def run(layers):
        model = small_resnet(torch.float64, depths=(1, 1))  # dropout 0.1 on: masks must match too
        batch = resnet_batch(model, dtype=torch.float64)
        if layers:
            apply_checkpointing(model, layers=layers)
        loss, grads, saved = step(model, compile_fresh(model.loss, "aot_eager"), batch)
        return [loss, *grads, *model.buffers()], saved, graph_breaks()

    plain, plain_saved, _ = run(None)
    wrapped, saved, breaks = run("Bottleneck")
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped, strict=True))
    assert saved < plain_saved and breaks == 0


def test_dropout_masks_equal_under_compile() -> None:
    def run(keys):
        model, batch = gpt(dropout=0.1)
        if keys:
            apply_checkpointing(model, **keys)
        return step(model, compile_fresh(model.loss, "aot_eager"), batch)

    (loss, grads, _), (loss2, grads2, _) = run(None), run(KEYS["full"])
    assert torch.equal(loss, loss2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_names_policy_under_compile_is_a_clear_error() -> None:
    model, batch = gpt()
    apply_checkpointing(model, layers="TransformerBlock", mode="selective", policy="names", save_names=["attn_out"])
    compiled = compile_fresh(model.loss, "aot_eager")
    with pytest.raises(Exception, match=re.escape(NAMES_UNDER_COMPILE)):
        compiled(batch)

"""planning/timing.py: what holds whatever the clock says.

Every name and option timed; the step predictions add up; a layer never called
costs nothing and one called twice counts twice; the cache is used; the model
comes back bitwise as it was (parameters, buffers, ``.grad``, RNG, wrappers);
and what the measurement holds at its peak stays below half of what the
un-checkpointed step holds. No assertion reads a timing value.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn

from ckpt_plugin import apply_checkpointing, wrapped_modules
from ckpt_plugin._compat import TorchDispatchMode, tree_leaves
from ckpt_plugin.engine.selective.policies import make_policy
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.measure.memory import step_memory
from ckpt_plugin.planning.options import FULL, KEEP, SELECTIVE
from ckpt_plugin.planning.timing import LayerTimes, measure_layer_times

# The planner's options, run as profile.treatment runs them, built from the engine so the test does not lean on
# the planner.
OPTIONS = {KEEP: None, SELECTIVE: Treatment(policy=make_policy("matmuls")), FULL: Treatment()}
BLOCKS = [f"blocks.{i}" for i in range(4)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _measure(model: nn.Module, names: list[str], forward, **kwargs) -> LayerTimes:
    return measure_layer_times(model, names, forward, OPTIONS, repeats=1, **kwargs)


def test_every_layer_and_option_is_timed_and_the_predictions_add_up() -> None:
    model = small_gpt()
    batch = gpt_batch(model)
    times = _measure(model, BLOCKS, lambda: model.loss(batch))
    assert list(times.seconds) == BLOCKS
    assert all(list(row) == list(OPTIONS) and all(s > 0 for s in row.values()) for row in times.seconds.values())
    assert times.full_step_seconds > 0
    assert times.added("blocks.0", KEEP) == 0
    assert times.predicted_seconds({}) == times.predicted_none_seconds
    assert times.predicted_seconds(dict.fromkeys(BLOCKS, FULL)) == pytest.approx(times.full_step_seconds)
    mixed = {"blocks.1": SELECTIVE, "blocks.3": FULL}
    expected = times.predicted_none_seconds + times.added("blocks.1", SELECTIVE) + times.added("blocks.3", FULL)
    assert times.predicted_seconds(mixed) == pytest.approx(expected)
    assert "blocks.3" in str(times)
    with pytest.raises(ValueError, match=r"no timings for 'blocks.9'; timed: blocks.0, blocks.1"):
        times.predicted_seconds({"blocks.9": FULL})


@pytest.mark.parametrize(("names", "options", "message"), [
    (["blocks.0", "nope"], OPTIONS, r"no module named 'nope' in GPT"),
    (["blocks.0", "blocks.0.attn"], OPTIONS, r"selected 'blocks.0.attn' inside 'blocks.0'"),
    (BLOCKS, {FULL: Treatment()}, r"options must map 'keep' to None and 'full' to a Treatment"),
])
def test_bad_arguments_are_named(names, options, message) -> None:
    model = small_gpt()
    with pytest.raises(ValueError, match=message):
        measure_layer_times(model, names, lambda: model.loss(gpt_batch(model)), options)


def _state(model: nn.Module) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "grad_values": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "rng": torch.get_rng_state(),
        "forwards": {n: m.__dict__.get("forward") for n, m in model.named_modules()},
    }


@pytest.mark.parametrize("kind", ["gpt", "resnet"])  # dropout draws random numbers; BatchNorm updates statistics
def test_the_model_comes_back_bitwise(kind: str) -> None:
    if kind == "gpt":
        model, names = small_gpt(), BLOCKS
        batch = gpt_batch(model)
    else:
        model = small_resnet()
        names = [n for n, m in model.named_modules() if type(m).__name__ == "Bottleneck"]
        batch = resnet_batch(model)
    model.loss(batch).backward()  # gradients to keep: some parameters have one, some not
    params = list(model.parameters())
    for p in params[::3]:
        p.grad = None
    before = _state(model)
    _measure(model, names, lambda: model.loss(batch))
    after = _state(model)
    assert before["tensors"].keys() == after["tensors"].keys()
    assert all(torch.equal(before["tensors"][k], after["tensors"][k]) for k in before["tensors"])
    assert all(before["grads"][n] is after["grads"][n] for n in before["grads"])  # the very tensors, or None
    assert all(torch.equal(v, after["grad_values"][n]) for n, v in before["grad_values"].items())
    assert torch.equal(before["rng"], after["rng"])
    assert all(f is None for f in after["forwards"].values())


@pytest.mark.parametrize("keys", [
    {"mode": "selective", "policy": "matmuls"},
    {"mode": "full", "segments": 2},  # a chain of segments: paused, then back
])
def test_a_wrapped_model_is_measured_unwrapped_and_keeps_its_wrappers(keys) -> None:
    model = small_gpt()
    batch = gpt_batch(model)
    wrapped = apply_checkpointing(model, layers="TransformerBlock", **keys)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    attributes = {n: dict(vars(m)) for n, m in model.named_modules()}
    times = _measure(model, BLOCKS, lambda: model.loss(batch))
    assert list(times.seconds) == BLOCKS
    assert wrapped_modules(model) == wrapped
    assert all(m.__dict__.get("forward") is forwards[n] for n, m in model.named_modules())
    assert all(vars(m).keys() == attributes[n].keys() for n, m in model.named_modules())


class _Twice(nn.Module):
    """``used`` runs twice per step (same shapes), ``unused`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(self.used(x)).pow(2).mean()


def test_a_layer_called_twice_counts_twice_and_one_never_called_costs_nothing() -> None:
    torch.manual_seed(0)
    model, x = _Twice(), torch.randn(4, 8)
    cache: dict = {}
    times = _measure(model, ["used", "unused"], lambda: model(x), cache=cache)
    assert times.seconds["unused"] == dict.fromkeys(OPTIONS, 0.0)
    # Alike inputs: timed once per option, counted for both calls.
    # The cache names them, and keep's forward alone (what offload's copies out hide behind, offload_plan.py).
    assert sorted(option for (option, _sig) in cache) == sorted([*map(str, OPTIONS), "keep forward"])
    assert all(sig[0][0] == "Sequential" for (_option, sig) in cache)
    per_call = {option: s for (option, _sig), s in cache.items()}
    forward = per_call.pop("keep forward")
    assert {str(o): s for o, s in times.seconds["used"].items()} == {option: 2 * s for option, s in per_call.items()}
    assert times.forward_seconds == {"used": 2 * forward}  # a forward inside its own forward + backward
    assert 0 < forward < per_call["keep"]


def test_alike_layers_are_timed_once() -> None:
    """Twelve alike blocks cost one block's timing: one cache entry per option, the same seconds each."""
    model = small_gpt(n_layer=3)
    x, y = gpt_batch(model)
    cache: dict = {}
    names = [f"blocks.{i}" for i in range(3)]
    times = _measure(model, names, lambda: model.loss((x, y)), cache=cache)
    assert len(cache) == len(OPTIONS) + 1  # and keep's forward alone
    assert times.seconds["blocks.0"] == times.seconds["blocks.1"] == times.seconds["blocks.2"]
    assert times.forward_seconds["blocks.0"] == times.forward_seconds["blocks.1"] == times.forward_seconds["blocks.2"]


def test_the_cache_keeps_timings_per_input_shape() -> None:
    model = small_gpt()
    cache: dict = {}
    first = _measure(model, BLOCKS, lambda: model.loss(gpt_batch(model, batch=2)), cache=cache)
    assert len(cache) == len(OPTIONS) + 1  # alike blocks share one timing (and one of keep's forward alone)
    again = _measure(model, BLOCKS, lambda: model.loss(gpt_batch(model, batch=2)), cache=cache)
    assert again.seconds == first.seconds  # read back, not timed again
    _measure(model, BLOCKS, lambda: model.loss(gpt_batch(model, batch=3)), cache=cache)
    assert len(cache) == 2 * (len(OPTIONS) + 1)  # another batch size: timed anew


class _LivePeak(TorchDispatchMode):
    """Peak bytes alive of the storages that ops make while it is on: activations, temporaries
    and gradients alike (parameters and buffers exist before). Exact on CPU.

    Not MemTracker: its module tracker takes the backward each layer runs inside the
    forward for the end of the step (it pops the root, then calls the next root call
    "multiple iterative calls" and raises).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.alive: dict[int, Any] = {}  # id(storage) -> weakref
        self.external = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.alive and key not in self.external:
                    self.live += storage.nbytes()
                    self.alive[key] = weakref.ref(storage, functools.partial(self._freed, key, storage.nbytes()))
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key: int, nbytes: int, _ref: Any) -> None:
        self.live -= nbytes
        del self.alive[key]


def _live_peak(model: nn.Module, run) -> int:
    with _LivePeak(model) as tracker:
        run()
    return tracker.peak


def test_the_measurement_holds_one_layer_not_the_step() -> None:
    # A deeper stack and a larger batch, so that one layer's activations are a small part of the step's.
    model = small_gpt(n_layer=6, block_size=64)
    batch = gpt_batch(model, batch=8)
    names = [f"blocks.{i}" for i in range(6)]

    def plain_step() -> None:
        model.loss(batch).backward()
        model.zero_grad(set_to_none=True)

    plain = _live_peak(model, plain_step)
    assert plain >= step_memory(plain_step, model)["act"]  # MemTracker's act peak is part of it
    measured = _live_peak(model, lambda: _measure(model, names, lambda: model.loss(batch)))
    assert 0 < measured < plain / 2, (measured, plain)

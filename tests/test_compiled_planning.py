"""``ckpt=auto`` plans the step the user runs: options timed compiled where the step compiles them.

- which options are timed compiled, for every ``ckpt.timing`` with and without
  ``ckpt.compile`` and a model the user compiled (``timed_compiled``);
- what counts as compiled by the user: ``torch.compile(model)``, ``Module.compile()``
  on a layer or a parent of it, a compiled child module, Lightning's ``from_compiled``;
- ``measure_layer_times(compiled=...)`` compiles each option once for all alike
  blocks (a counting backend over ``aot_eager``: exactly three graphs for four
  blocks), leaves the model, its gradients and torch.compile's stance as they were,
  and runs what the user compiled eagerly while it measures (no graph of theirs);
- an option timed compiled keeps a negative difference to ``keep`` (fused, it can make the
  step faster), one timed eagerly reads it as 0;
- with the whole step compiled, what the rest of the model keeps is measured compiled
  (``whole_step``): exactly what a user's ``torch.compile`` of the loss keeps beyond the
  layers, more than it keeps eagerly (the attention bias torch saves across regions);
- ``apply_checkpointing(mode="auto", timing=...)`` on a GPT whose blocks the user
  compiled: the plan says how it was timed, and the compiled, checkpointed step's
  loss and gradients are bitwise those of the same compiled model without the plugin.

``aot_eager`` throughout (dynamo's capture and AOTAutograd's partition without
inductor's C++ build); ``ckpt-bench``'s compiled entry times through inductor.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from conftest import compiled_backward_bytes, gpt_batch, small_gpt
from lightning.pytorch.utilities.compile import from_compiled
from torch._dynamo.backends.registry import lookup_backend

from ckpt_plugin import apply_checkpointing, remove_checkpointing
from ckpt_plugin._compat import compiled_by_user
from ckpt_plugin.apply.auto import timed_compiled
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.planning.options import FULL, KEEP, OPTIONS, SELECTIVE, SELECTIVE_NB
from ckpt_plugin.engine.regional import CompiledCalls
from ckpt_plugin.planning.profile import profile, treatment, with_times
from ckpt_plugin.measure.memory import saved_bytes
from ckpt_plugin.planning.timing import LayerTimes, _kept_bytes, measure_layer_times
from ckpt_tools.workloads import MODELS, build

BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
ALL = dict.fromkeys(OPTIONS, "inductor")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _auto(**keys):
    return make_config(**{"mode": "auto", "layers": "blocks.*", "budget": 0.5} | keys)


@pytest.mark.parametrize(("keys", "user_compiled", "expected"), [
    ({}, False, {}),
    ({}, True, ALL),
    ({"compile": "aot_eager"}, False, {SELECTIVE: "aot_eager", SELECTIVE_NB: "aot_eager", FULL: "aot_eager"}),
    ({"compile": True}, True, ALL),
    ({"timing": "eager"}, True, {}),
    ({"timing": "eager", "compile": True}, False, {}),
    ({"timing": "compiled"}, False, ALL),
    ({"timing": "aot_eager"}, False, dict.fromkeys(OPTIONS, "aot_eager")),
    ({"timing": "aot_eager", "compile": True}, False,
     {SELECTIVE: "aot_eager", SELECTIVE_NB: "aot_eager", FULL: "aot_eager"}),
], ids=["eager-step", "user-compiled", "regional", "regional-in-user-compiled", "forced-eager",
        "forced-eager-regional", "compiled", "named-backend", "named-backend-regional"])
def test_the_options_are_timed_as_the_step_runs_them(keys, user_compiled, expected) -> None:
    config = _auto(**keys)
    from ckpt_plugin.config.values import backend_of

    assert timed_compiled(config, backend_of(config.compile), user_compiled) == expected


def test_what_the_user_compiled_is_seen() -> None:
    assert not compiled_by_user(small_gpt(), BLOCKS)
    model = small_gpt()
    assert compiled_by_user(torch.compile(model, backend="aot_eager"), BLOCKS)  # the whole model
    model.blocks[2].compile(backend="aot_eager")  # one layer, in place
    assert compiled_by_user(model, ["blocks.2"]) and not compiled_by_user(model, ["blocks.1"])
    parent = small_gpt()
    parent.blocks.compile(backend="aot_eager")  # a parent of the layers
    assert compiled_by_user(parent, BLOCKS)
    child = small_gpt()
    child.blocks[0] = torch.compile(child.blocks[0], backend="aot_eager")  # a compiled module put in its place
    assert compiled_by_user(child, ["blocks.0._orig_mod"])
    lightning = small_gpt()
    from_compiled(torch.compile(lightning, backend="aot_eager"))  # what trainer.fit(torch.compile(model)) keeps
    assert compiled_by_user(lightning, BLOCKS)


class CountingBackend:
    """aot_eager, counting the graphs it compiles (forward graphs; each backward is compiled with its forward)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.inner = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def test_each_option_compiles_once_for_all_alike_blocks_and_leaves_no_trace() -> None:
    model = small_gpt(dropout=0.0)
    model.blocks[1].compile(backend="aot_eager")  # the user's own compile: run eagerly while measuring
    batch = gpt_batch(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    counting = CountingBackend()
    torch._dynamo.utils.counters.clear()
    times = measure_layer_times(model, BLOCKS, lambda: model.loss(batch), {o: treatment(o) for o in OPTIONS},
                                repeats=1, compiled=dict.fromkeys(OPTIONS, counting))
    assert counting.graphs == 4  # keep, selective, selective_nb and full: one graph each for the four alike blocks
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4  # nothing of the user's compiled
    assert set(times.seconds) == set(BLOCKS) and all(set(row) == set(OPTIONS) for row in times.seconds.values())
    assert times.how.startswith("keep, selective, selective_nb and full compiled (")
    assert all(p.grad is None for p in model.parameters())
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.compiler.is_compiling()
    # torch.compile's stance is its default again: the user's compiled block compiles when called.
    model.loss(batch)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 5


def test_only_the_options_asked_run_compiled() -> None:
    model = small_gpt(dropout=0.0, n_layer=2)
    batch = gpt_batch(model)
    counting = CountingBackend()
    times = measure_layer_times(model, BLOCKS[:2], lambda: model.loss(batch), {o: treatment(o) for o in OPTIONS},
                                repeats=1, compiled={SELECTIVE: counting, FULL: counting})
    assert counting.graphs == 2
    assert times.how == f"selective and full compiled ({counting}); keep and selective_nb eager"
    with pytest.raises(ValueError, match=r"compiled names 'al', not options: keep, selective, selective_nb, full"):
        measure_layer_times(model, BLOCKS[:2], lambda: model.loss(batch), {o: treatment(o) for o in OPTIONS},
                            compiled={"al": "aot_eager"})


def test_auto_on_a_model_the_user_compiled_plans_compiled_and_trains_bitwise(caplog) -> None:
    torch.manual_seed(0)
    plain, ours = small_gpt(dropout=0.1), small_gpt(dropout=0.1)
    for model in (plain, ours):
        for block in model.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
    batch = gpt_batch(plain)
    caplog.set_level(logging.INFO, logger="ckpt_plugin")
    wrapped = apply_checkpointing(ours, layers="blocks.*", mode="auto", budget=0.6, timing="aot_eager")
    assert wrapped
    assert "measured layer by layer, keep, selective, selective_nb and full compiled (aot_eager))" in caplog.text
    losses = []
    for model in (plain, ours):
        torch.manual_seed(3)
        loss = model.loss(batch)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad), name
    remove_checkpointing(ours)


def test_compiled_options_keep_what_their_compiled_backward_saves() -> None:
    """``kept_bytes`` of a compiled option: its compiled call's saved tensors, read here off autograd's
    ``CompiledFunctionBackward`` node instead of through saved-tensor hooks, plus the block's input."""
    model = small_gpt(dropout=0.0, n_layer=2)
    batch = gpt_batch(model)
    times = measure_layer_times(model, BLOCKS[:2], lambda: model.loss(batch), {o: treatment(o) for o in OPTIONS},
                                repeats=1, compiled=dict.fromkeys(OPTIONS, "aot_eager"))
    inputs = []
    handle = model.blocks[0].register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    with torch.no_grad():
        model.loss(batch)
    handle.remove()
    calls = {o: CompiledCalls("aot_eager", treatment(o) or treatment(FULL), 2) for o in OPTIONS}
    for option in OPTIONS:
        x = inputs[0].detach().requires_grad_(True).clone()
        holder = torch.nn.Module()  # the block's weights and its input: not counted as saved (the input comes after)
        holder.block = model.blocks[0]
        holder.register_buffer("x", x)
        if option == KEEP:
            out = calls[option].uncheckpointed(model.blocks[0].forward, (x,), {}, "blocks.0")
        else:
            out = calls[option].checkpointed(model.blocks[0].forward, (x,), {}, "blocks.0")
        saved, nodes = compiled_backward_bytes(out.sum(), holder)
        assert nodes == 1
        assert times.kept_bytes["blocks.0"][option] == saved + x.untyped_storage().nbytes(), option
    assert times.kept_bytes["blocks.0"] == times.kept_bytes["blocks.1"]  # alike blocks: measured once
    # The same count of the eager call is the profile's kept bytes (fake tensors, MemTracker's way), so a compiled
    # option's count can stand in for its eager one in the plan (profile.with_times).
    eager = profile(model, BLOCKS[:2], lambda: model.loss(batch))
    x = inputs[0].detach().requires_grad_(True).clone()
    assert _kept_bytes(model.blocks[0].forward, model.blocks[0], (x,), {}) == eager.layers[0].options[KEEP].kept_bytes


def test_the_plan_counts_the_bytes_the_compiled_options_keep() -> None:
    quick = build(MODELS["gpt"], "none", quick=True)  # ckpt-bench --quick's GPT: 64 tokens, width 64
    model, batch = quick.model, quick.batch
    eager = profile(model, BLOCKS, lambda: model.loss(batch))
    times = measure_layer_times(model, BLOCKS, lambda: model.loss(batch), {o: treatment(o) for o in OPTIONS},
                                repeats=1, compiled={KEEP: "aot_eager", FULL: "aot_eager"})
    planned = with_times(eager, times)
    shift = 0
    for before, after in zip(eager.layers, planned.layers, strict=True):
        compiled = times.kept_bytes[after.name]
        assert after.options[SELECTIVE].kept_bytes == before.options[SELECTIVE].kept_bytes  # timed eagerly
        for option in (KEEP, FULL):
            delta = compiled[option] - before.options[option].kept_bytes
            assert after.options[option].kept_bytes == compiled[option]
            assert after.options[option].running_bytes == before.options[option].running_bytes + delta
        shift += compiled[KEEP] - before.options[KEEP].kept_bytes
    assert shift < 0  # compiled, a kept block keeps less: the partitioner recomputes cheap ops
    assert planned.no_ckpt_peak == eager.no_ckpt_peak + shift  # a fraction budget is of the step as it runs
    assert planned.timed_as == "keep and full compiled (aot_eager); selective and selective_nb eager"


def test_a_compiled_option_may_save_time_an_eager_one_never_does() -> None:
    """``with_times``: the measured difference to ``keep`` stands for an option timed compiled, negative too
    (compiled, ``selective`` ran faster than ``none`` on the example GPT); eagerly, less than ``keep`` is noise."""
    model = small_gpt(dropout=0.0, n_layer=2)
    batch = gpt_batch(model)
    eager = profile(model, BLOCKS[:2], lambda: model.loss(batch))
    seconds = {name: {KEEP: 0.010, SELECTIVE: 0.008, SELECTIVE_NB: 0.009, FULL: 0.012} for name in BLOCKS[:2]}
    times = LayerTimes(seconds, full_step_seconds=0.1, compiled={SELECTIVE: "aot_eager"})
    planned = with_times(eager, times)
    for layer in planned.layers:
        assert layer.options[SELECTIVE].seconds == pytest.approx(-0.002)  # compiled: faster than keep, as measured
        assert layer.options[SELECTIVE_NB].seconds == 0.0  # eager: no faster than keep
        assert layer.options[FULL].seconds == pytest.approx(0.002)
    # With the budget of the whole peak nothing is wrapped; below it the planner takes the faster option.
    chosen = planned.plan(int(0.9 * planned.no_ckpt_peak))
    assert set(chosen.choices.values()) <= {KEEP, SELECTIVE} and SELECTIVE in chosen.choices.values()


def test_the_rest_of_a_step_compiled_whole_is_measured_compiled() -> None:
    """``whole_step``: what the rest of the model keeps with the step compiled whole and every layer ``full``
    equals what a user's ``torch.compile`` of the loss keeps beyond the layers' compiled ``full`` calls, and the
    plan counts it (more than the eager rest: torch saves the SDPA decomposition's zero bias, CSE'd from every
    block's region into the first, for the later regions)."""
    model = small_gpt(n_layer=2)  # dropout on: SDPA decomposes (math), with its zero bias
    batch = gpt_batch(model)
    blocks = BLOCKS[:2]
    backend = "aot_eager_decomp_partition"  # inductor's decompositions and partitioner, as for inductor
    options = {o: treatment(o) for o in OPTIONS}
    times = measure_layer_times(model, blocks, lambda: model.loss(batch), options, repeats=1,
                                compiled={KEEP: backend, FULL: backend}, whole_step=True)
    eager = profile(model, blocks, lambda: model.loss(batch))
    assert times.compiled_rest_bytes > eager.rest_bytes
    apply_checkpointing(model, layers="blocks.*", mode="full")
    loss = torch.compile(model.loss, backend=backend, fullgraph=True)
    whole = saved_bytes(model, lambda: loss(batch), owners=[]).total
    remove_checkpointing(model)
    assert whole == times.compiled_rest_bytes + sum(times.kept_bytes[name][FULL] for name in blocks)
    planned = with_times(eager, times)
    assert planned.rest_bytes == times.compiled_rest_bytes
    assert planned.rest_running == eager.rest_running + times.compiled_rest_bytes - eager.rest_bytes
    # Without the whole step compiled (ckpt.compile: the rest runs eagerly) nothing of it is compiled.
    regional = measure_layer_times(model, blocks, lambda: model.loss(batch), options, repeats=1,
                                   compiled={FULL: backend}, whole_step=True)
    assert regional.compiled_rest_bytes is None

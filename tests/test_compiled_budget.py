"""``ckpt_tools.compiled``: torch's own memory budget under ``torch.compile`` (issue #12).

On the quick GPT (ckpt-bench ``--quick``'s sizes, dropout off so that compiled
and eager gradients compare), compiled with ``aot_eager``: the same dynamo
capture and AOTAutograd min-cut partition as inductor, without the C++ build
(about 30 s per inductor compile on 2 cores). Only exact quantities: bytes
kept for backward, gradients, how many graphs were compiled; no timings.

The two compiled models of the fixture run one code object (``GPT.loss``) in
one process without ``torch.compiler.reset()`` between them: that each keeps
its own bytes proves each got its own compiled graph and budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import compiled_backward_bytes

from ckpt_examples.gpt import GPT
from ckpt_plugin.measure.memory import saved_bytes
from ckpt_tools.compiled import compiled_run, measure_compiled_budget
from ckpt_tools.workloads import MODELS

BUDGET = 0.5


def quick_gpt() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    spec = MODELS["gpt"]
    torch.manual_seed(0)
    model = GPT(**spec.quick | {"dropout": 0.0})
    model.train()
    return model, spec.batch(model, torch.Generator().manual_seed(1))


@dataclass
class Result:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    saved: int  # measure: saved_bytes (saved_tensors_hooks)
    node_saved: int | None = None  # the compiled backward node's saved_tensors
    nodes: int | None = None
    compiles: int | None = None


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    torch.compiler.reset()
    out = {}
    for name, budget in (("none", 1.0), ("budget", BUDGET)):
        model, batch = quick_gpt()
        run = compiled_run(model, batch, budget, backend="aot_eager")
        loss = run.loss_fn(batch)  # compiles, the budget set by the run's own backend
        node_saved, nodes = compiled_backward_bytes(loss, model)
        loss.backward()
        out[name] = Result(loss.detach(), [p.grad.clone() for p in model.parameters()], run.saved_bytes(),
                           node_saved, nodes, run.backend.compiles)
    model, batch = quick_gpt()
    loss = model.loss(batch)
    loss.backward()
    out["eager"] = Result(loss.detach(), [p.grad.clone() for p in model.parameters()],
                          saved_bytes(model, lambda: model.loss(batch), owners=[]).total)
    return out


def test_the_budget_keeps_less_than_compiled_none(results: dict[str, Result]) -> None:
    """Less, not at most half: the partitioner's 0.5 is of its own estimate beyond the graph's
    inputs (parameters, batch); measured 2330624 of 4463108 bytes (0.522) on this GPT."""
    none, budget = results["none"], results["budget"]
    assert 0 < budget.saved < none.saved


@pytest.mark.parametrize("name", ["none", "budget"])
def test_saved_bytes_is_what_the_compiled_backward_keeps(results: dict[str, Result], name: str) -> None:
    """One graph, compiled once, and the hooks count exactly its backward node's saved tensors."""
    run = results[name]
    assert (run.nodes, run.compiles) == (1, 1)
    assert run.saved == run.node_saved


def test_compiled_none_keeps_no_more_than_eager(results: dict[str, Result]) -> None:
    assert results["none"].saved <= results["eager"].saved


@pytest.mark.parametrize("name", ["none", "budget"])
def test_compiled_gradients_equal_eager_without_checkpointing(results: dict[str, Result], name: str) -> None:
    run, eager = results[name], results["eager"]
    torch.testing.assert_close(run.loss, eager.loss, rtol=1e-6, atol=0.0)
    for got, expected in zip(run.grads, eager.grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_measure_compiled_budget_rows(results: dict[str, Result]) -> None:  # after the fixture: it resets dynamo
    plugin = ["plugin_full", "plugin_auto_0.5"]
    result = measure_compiled_budget(quick=True, rounds=1, steps=1, backend="aot_eager", plugin=plugin)
    rows = ("compiled_none", "compiled_budget", "eager_none", "eager_auto")
    assert {"budget", "backend", "model", "act_fraction", "time_ratio", "eager_act_fraction",
            "eager_time_ratio", *rows} <= result.keys()
    assert (result["budget"], result["backend"], result["model"]) == (BUDGET, "aot_eager", MODELS["gpt"].quick)
    for row in rows:
        assert result[row]["saved_bytes"] > 0 and result[row]["step_seconds"] > 0
    assert result["act_fraction"] == result["compiled_budget"]["saved_bytes"] / result["compiled_none"]["saved_bytes"]
    assert 0 < result["act_fraction"] < 1
    assert result["compiled_none"]["saved_bytes"] <= result["eager_none"]["saved_bytes"]
    assert result["eager_auto"]["wrapped"] and result["eager_act_fraction"] < 1
    # The plugin's rows: its mode applied, then the loss compiled whole like compiled none (one graph each).
    assert list(result["plugin"]) == plugin
    full, auto = result["plugin"]["plugin_full"], result["plugin"]["plugin_auto_0.5"]
    assert full["wrapped"] == [f"blocks.{i}" for i in range(MODELS["gpt"].quick["n_layer"])]
    for row in (full, auto):
        assert row["act_fraction"] == row["saved_bytes"] / result["compiled_none"]["saved_bytes"] < 1
        assert row["step_seconds"] > 0 and row["time_ratio"] > 0
    assert full["saved_bytes"] < auto["saved_bytes"]  # full keeps the block inputs alone
    assert "keep, selective, selective_nb and full compiled (aot_eager))" in auto["plan"] and auto["wrapped"]
    with pytest.raises(ValueError, match=r"plugin rows 'plugin_ful': valid rows are plugin_full, plugin_selective"):
        measure_compiled_budget(quick=True, backend="aot_eager", plugin=["plugin_ful"])


def test_a_budget_outside_0_1_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"budget=1\.5: must be a fraction in \[0, 1\]"):
        measure_compiled_budget(quick=True, budget=1.5)

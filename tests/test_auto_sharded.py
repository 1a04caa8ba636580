"""ckpt=auto under FSDP and DeepSpeed ZeRO-3: two processes (gloo, CPU), one launch of tests/auto_sharded_worker.py.

Found by running it (torch 2.13, Lightning 2.6.6): planning there, outside the strategy's own call,
never hung but broke every time. FSDP: "'weight' must be 2-D, got 1-D" (the root unit's parameters
are flat shards); FSDP2: a plan was made and installed, then the first step trained on the fake
all-gathered parameters the profile left behind (DataDependentOutputException at logging); ZeRO-1, 2
and 3: "Cannot copy out of meta tensor" in the first real backward (DeepSpeed's gradient hooks took the
profile's fake gradients). The wrap report's fake forward broke FSDP, FSDP2 and ZeRO-3 the same way,
for ckpt=full too, wherever the module has an example_input_array. Now planning under DeepSpeed is a
ConfigError in setup on every rank; under FSDPStrategy rank 0 plans in setup, before the strategy shards
the module, and under ModelParallelStrategy before the module's configure_model shards it (FSDP2, on a
fake twin whose own configure_model ran on a mesh of fake groups). A plan made under DDP installs with ckpt.plan, with the step's gradients
bitwise those of the same strategy without checkpointing. ~20 s on 2 cores (DeepSpeed's import ~4 s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import warm_python

WORKER = Path(__file__).with_name("auto_sharded_worker.py")
REFUSED = (
    "ckpt.mode=auto cannot plan under trainer.strategy {}: its profile runs the LightningModule's forward and "
    "backward outside the strategy, which shards the parameters or hooks the gradients; plan with the same model "
    "and per-device batch on one process or under DDP (the ckpt=auto run writes ckpt_plan.json in its log dir) "
    "and give that file here with ckpt.plan=<file>, or choose a fixed mode (ckpt=full, ckpt=selective, ckpt=offload)"
)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("auto_sharded") / "run"
    plan = str(out / "ddp_auto" / "ckpt_plan.json")  # rank 0 of the first run writes it
    runs = {  # in this order, in one pair of processes; the errors last
        "ddp_auto": ["ddp", {"mode": "auto", "budget": 0.5}],
        "fsdp_none": ["fsdp", None],
        "fsdp_plan": ["fsdp", {"mode": "auto", "plan": plan}],
        "zero3_none": ["deepspeed_zero3", None],
        "zero3_plan": ["deepspeed_zero3", {"mode": "auto", "plan": plan}],
        "fsdp_auto": ["fsdp", {"mode": "auto", "budget": 0.5}],
        "fsdp2_none": ["fsdp2", None],  # ModelParallelStrategy, the layers built in __init__
        "fsdp2_auto": ["fsdp2", {"mode": "auto", "budget": 0.5}],
        "fsdp2_deferred_auto": ["model_parallel", {"mode": "auto", "budget": 0.5}],  # built in configure_model
        "zero3_auto": ["deepspeed_zero3", {"mode": "auto", "budget": "min"}],
        "zero3_memory": ["deepspeed_zero3", {"mode": "auto", "memory": "64MiB"}],
    }
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
                        "OMP_NUM_THREADS": "1"}
    proc = warm_python.run([str(WORKER), str(out), json.dumps(runs)], env=env, cwd=out.parent, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def ranks(out: Path, run: str) -> list[dict]:
    return [json.loads((out / run / f"rank{r}.json").read_text()) for r in range(2)]


def test_planning_under_deepspeed_is_the_same_config_error_on_every_rank(out: Path) -> None:
    refused = REFUSED.format("CPUDeepSpeedStrategy (ZeRO stage 3)")
    assert [r["error"] for r in ranks(out, "zero3_auto")] == [["ConfigError", refused]] * 2


def test_under_fsdp_rank_zero_plans_before_sharding_and_every_rank_installs_it_bitwise(out: Path) -> None:
    """FSDPStrategy: ckpt=auto plans in setup, on the whole module, and installs at fit start on the modules FSDP
    wrapped; the step's gradients are those without checkpointing, bit for bit (SGD: equal parameters)."""
    planned = ranks(out, "fsdp_auto")
    for rank in planned:
        assert "error" not in rank, rank
        assert rank["wrapped"] and rank["wrapped"] == planned[0]["wrapped"]
        assert rank["choices"] == planned[0]["choices"] and rank["installed"] == planned[0]["installed"]
    assert Path(planned[0]["plan_path"]) == out / "fsdp_auto" / "ckpt_plan.json"
    for r in range(2):
        with_plan = torch.load(out / "fsdp_auto" / f"rank{r}.pt", weights_only=True)
        without = torch.load(out / "fsdp_none" / f"rank{r}.pt", weights_only=True)
        assert with_plan.keys() == without.keys() and with_plan
        assert all(torch.equal(with_plan[n], p) for n, p in without.items())


def test_under_fsdp2_rank_zero_plans_on_a_twin_the_module_shards_and_every_rank_installs_it_bitwise(out: Path) -> None:
    """ModelParallelStrategy: rank 0 plans in setup, before configure_model shards the module (the twin's own
    configure_model ran on a mesh of fake groups); every rank installs the plan on the names fully_shard kept."""
    planned = ranks(out, "fsdp2_auto")
    for rank in planned:
        assert "error" not in rank, rank
        assert rank["wrapped"] and rank["wrapped"] == planned[0]["wrapped"]
        assert rank["choices"] == planned[0]["choices"] and rank["installed"] == planned[0]["installed"]
    for r in range(2):  # SGD: equal parameters after the step are equal gradients; gathered in full
        with_plan = torch.load(out / "fsdp2_auto" / f"rank{r}.pt", weights_only=True)
        without = torch.load(out / "fsdp2_none" / f"rank{r}.pt", weights_only=True)
        assert with_plan.keys() == without.keys() and with_plan
        assert all(torch.equal(with_plan[n], p) for n, p in without.items())


def test_under_fsdp2_layers_built_in_configure_model_are_a_config_error_on_every_rank(out: Path) -> None:
    errors = [r["error"] for r in ranks(out, "fsdp2_deferred_auto")]
    assert errors[0] == errors[1] and errors[0][0] == "ConfigError"
    assert ("under ModelParallelStrategy ckpt=auto plans in the callback's setup, while the module is whole, "
            "before SGDGPT.configure_model (or setup) builds layers") in errors[0][1]


def test_a_whole_step_under_deepspeed_is_refused_on_every_rank_naming_ckpt_memory(out: Path) -> None:
    said = (
        "ckpt.memory=64MiB cannot be planned under trainer.strategy CPUDeepSpeedStrategy (ZeRO stage 3): the whole "
        "step on one rank is measured on a fake twin that the strategy shards as it shards the module, and of the "
        "sharded strategies only Lightning's FSDPStrategy (FSDP v1) and ModelParallelStrategy (FSDP2) are modelled so "
        "far; under FSDPStrategy, ModelParallelStrategy, DDP or on one device ckpt.memory plans the whole step; here "
        "plan the activations on one process (ckpt.budget, "
        "whose run writes ckpt_plan.json) and give that file with ckpt.plan=<file>, or choose a fixed mode "
        "(ckpt=full, ckpt=selective, ckpt=offload)")
    assert [r["error"] for r in ranks(out, "zero3_memory")] == [["ConfigError", said]] * 2


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_plan_made_under_ddp_installs_on_every_rank_and_the_gradients_are_bitwise(out: Path,
                                                                                    strategy: str) -> None:
    planned = ranks(out, "ddp_auto")[0]
    assert Path(planned["plan_path"]) == out / "ddp_auto" / "ckpt_plan.json"
    given = ranks(out, f"{strategy}_plan")
    for rank in given:
        assert "error" not in rank, rank
        assert rank["wrapped"] == planned["wrapped"] == ["blocks.0", "blocks.1"]
        assert rank["choices"] == planned["choices"] and rank["installed"] == planned["installed"]
    for r in range(2):  # SGD: equal parameters after the step are equal gradients; gathered in full
        with_plan = torch.load(out / f"{strategy}_plan" / f"rank{r}.pt", weights_only=True)
        without = torch.load(out / f"{strategy}_none" / f"rank{r}.pt", weights_only=True)
        assert with_plan.keys() == without.keys() and with_plan
        assert all(torch.equal(with_plan[n], p) for n, p in without.items())

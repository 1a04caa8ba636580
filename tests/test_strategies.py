"""The same one-line config under every Lightning strategy: 2 processes, gloo on CPU.

Each run (tests/dist_worker.py) trains a pair of identical GPTs under one
trainer preset, the plugin checkpointing only the second, so one run gives
both sides of every comparison: the losses of each step, bitwise; the
parameters after each SGD step gathered in full, bitwise (with plain SGD,
equal parameters mean equal gradients); and the attention's call count, which
doubles in the checkpointed copy when the recomputation really runs. All the
runs share one launch of the worker (one pair of processes: the imports once);
the worker prints each run's wall time.

Then the checks that need no processes: the strategy-level errors and warnings.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import warm_python
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch import nn

from ckpt_plugin.config.schema import make_config
from ckpt_plugin.lightning.strategies import prepare

WORKER = Path(__file__).with_name("dist_worker.py")
N_LAYER, STEPS = 2, 4
ALL_OPTIONS = [  # every DeepSpeed checkpointing option, switched on, through the ckpt node
    "ckpt=deepspeed", "ckpt.layers=ckpt.blocks.*", "ckpt.deepspeed.partition_activations=true",
    "ckpt.deepspeed.contiguous_memory_optimization=true", "ckpt.deepspeed.number_checkpoints=2",
    "ckpt.deepspeed.synchronize_checkpoint_boundary=true", "ckpt.deepspeed.profile=true",
]
RUNS = {  # in this order, in one pair of processes (dist_worker.py)
    "ddp": ("ddp", []),
    "fsdp": ("fsdp", []),
    "model_parallel": ("model_parallel", []),
    "deepspeed_zero1": ("deepspeed_zero1", []),
    "deepspeed_zero2": ("deepspeed_zero2", []),
    "deepspeed_zero3": ("deepspeed_zero3", []),
    # Last: the only run that checkpoints through DeepSpeed, whose options and contiguous buffers stay in
    # deepspeed.checkpointing's module globals; no run after it meets them. The options it reports are its
    # own wherever it runs: deepspeed.checkpointing.configure resets every one before it sets them.
    "deepspeed_zero3+deepspeed_checkpoint": ("deepspeed_zero3", ALL_OPTIONS),
}


def launch(runs: dict[str, tuple[str, list[str]]], out: Path, returncode: int = 0) -> str:
    """The worker's output; ``returncode``: the exit code expected (138: stopped by Preemption on SIGUSR1)."""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = warm_python.run_ranks([str(WORKER), str(out), json.dumps(runs)], 2, env=env, cwd=out.parent, timeout=600)
    output = proc.stdout + proc.stderr
    finished = "\n".join(line for line in output.splitlines() if line.startswith("[dist_worker]"))
    if proc.returncode != returncode:
        raise AssertionError(f"{list(runs)} exited {proc.returncode}, not {returncode}; finished:\n{finished}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(f"{finished}\nin all: {time.perf_counter() - start:.1f} s")
    return output


def read_results(out: Path, name: str) -> list[dict]:
    return [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict]]:
    """Every run of RUNS in one launch, once (a -k selection of one test starts them all); a failed
    launch is an error in every test that asks for it (pytest keeps a fixture's exception for its scope)."""
    out = tmp_path_factory.mktemp("runs")
    launch(RUNS, out)
    return lambda name: read_results(out, name)


@pytest.mark.parametrize("name", list(RUNS))
def test_same_losses_and_gradients_and_the_recompute_ran(name: str, results) -> None:
    ranks = results(name)
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["global_step"] == STEPS
        assert rank["wrapped"] == [f"ckpt.blocks.{i}" for i in range(N_LAYER)]
        # Bitwise: the checkpointed copy's loss at every step, and its parameters after every step.
        assert len(rank["losses"]) == STEPS
        assert all(plain == ckpt for plain, ckpt in rank["losses"]), rank["losses"]
        assert rank["param_diffs"] == [0.0] * STEPS
        # The recomputation really ran: each checkpointed block's attention once more per step.
        assert rank["attn_calls"] == {"plain": N_LAYER * STEPS, "ckpt": 2 * N_LAYER * STEPS}
    # The ranks saw different batches: a real data-parallel run, not one run twice.
    assert ranks[0]["losses"] != ranks[1]["losses"]


@pytest.mark.parametrize("name", ["deepspeed_zero3", "model_parallel"])
def test_preemption_saves_the_sharded_checkpoint_together_and_the_resume_is_exact(
    name: str, results, tmp_path: Path
) -> None:
    """A signal in rank 1's backward of step 1: both ranks write their shards at the end of the step, the
    directory appears whole under its final name, and the resumed run's losses are the uninterrupted run's."""
    preset, overrides = RUNS[name]
    if name == "model_parallel":
        overrides = [*overrides, "trainer.strategy.save_distributed_checkpoint=true"]  # a sharded (DCP) directory
    resumable = [
        *overrides, "callbacks=[activation_checkpointing,model_checkpoint]", f"trainer.default_root_dir={tmp_path}",
        f"callbacks.model_checkpoint.dirpath={tmp_path}/checkpoints", "ckpt_path=last",
    ]  # fmt: skip
    fault = "+callbacks.fault={_target_:preempt_faults.SendSignal,at:backward,step:1,ranks:[1]}"
    stopped = launch({name: (preset, [*resumable, fault])}, tmp_path / "out", returncode=138)
    assert "Preemption: rank 1: SIGUSR1; saving at step 2 on all 2 rank(s)" in stopped
    saved = tmp_path / "hpc_ckpt_1.ckpt"
    assert saved.is_dir() and len(list(saved.rglob("*"))) > 2  # the strategy's own sharded layout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing partial left
    launch({name: (preset, resumable)}, tmp_path / "out")
    resumed = read_results(tmp_path / "out", name)
    for rank in range(2):
        assert resumed[rank]["global_step"] == STEPS
        assert resumed[rank]["losses"] == results(name)[rank]["losses"][2:]  # steps 2 and 3, bitwise


def test_zero3_parameters_are_partitioned_while_it_runs(results) -> None:
    ranks = results("deepspeed_zero3")
    for rank in ranks:
        assert len(rank["local_elements"]) == STEPS
        for local, full in rank["local_elements"]:
            assert local < full  # this rank holds only its part of every parameter
    local = [r["local_elements"][0][0] for r in ranks]
    full = ranks[0]["local_elements"][0][1]
    assert full <= sum(local) <= full + 2 * len(local) * 64  # the parts cover the whole (with padding)


def test_deepspeed_options_are_passed_through_completely(results) -> None:
    for rank in results("deepspeed_zero3+deepspeed_checkpoint"):
        assert rank["deepspeed_checkpointing"] == {
            "PARTITION_ACTIVATIONS": True, "CPU_CHECKPOINT": False, "CONTIGUOUS_CHECKPOINTING": True,
            "num_layers": 2, "SYNCHRONIZE": True, "PROFILE_TIME": True,
        }


# ---------------------------------------------------------------------- strategy checks, no processes

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_fsdp_policy_and_the_plugin_together_is_an_error() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = nn.Sequential(Block(), Block())
    # What FSDPStrategy(activation_checkpointing_policy={Block}) does to the model in its setup.
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(ValueError, match=(
        r"^2 module\(s\) are already checkpointed by trainer.strategy \(FSDPStrategy\) "
        r"activation_checkpointing_policy / activation_checkpointing: 0, 1\. Checkpointing them again with "
        r"callbacks.activation_checkpointing would recompute every block twice; use one of the two: remove "
        r"the strategy's activation_checkpointing_policy \(the plugin works under every strategy\), or choose "
        r"ckpt=none$"
    )):
        prepare(FSDPStrategy(), model, make_config(layers="Block"))


def test_deepspeed_options_need_a_deepspeed_strategy() -> None:
    config = make_config(layers="Block", deepspeed={"partition_activations": True})
    with pytest.raises(ValueError, match=(
        r"^ckpt.deepspeed is set but trainer.strategy is DDPStrategy: DeepSpeed's own checkpoint needs a "
        r"DeepSpeed strategy \(Trainer\(strategy='deepspeed_stage_3'\), or the recipe's trainer=deepspeed_zero1/2/3\)"
    )):
        prepare(DDPStrategy(), nn.Sequential(Block()), config)


def test_strategy_level_deepspeed_options_are_not_dropped_silently() -> None:
    strategy = DeepSpeedStrategy(stage=3, partition_activations=True, cpu_checkpointing=True)
    with pytest.warns(UserWarning, match=(
        r"trainer.strategy sets DeepSpeed activation-checkpointing options \(partition_activations=True, "
        r"cpu_checkpointing=True\) .* move them into the ckpt node: ckpt=deepspeed "
        r"ckpt.deepspeed.partition_activations=true ckpt.deepspeed.cpu_checkpointing=true$"
    )):
        prepare(strategy, nn.Sequential(Block()), make_config(layers="Block"))


@pytest.mark.parametrize("keys, message", [
    ({"contiguous_memory_optimization": True, "partition_activations": True},
     "ckpt.deepspeed.contiguous_memory_optimization=true needs ckpt.deepspeed.number_checkpoints"),
    ({"contiguous_memory_optimization": True, "number_checkpoints": 4},
     "ckpt.deepspeed.contiguous_memory_optimization=true needs ckpt.deepspeed.partition_activations=true"),
    ({"number_checkpoints": 0}, "ckpt.deepspeed.number_checkpoints=0 must be null or an integer >= 1"),
    ({"partition_activation": True}, "unknown key ckpt.deepspeed.partition_activation; valid keys: "
                                     "partition_activations, cpu_checkpointing"),
    ({"profile": "yes"}, "ckpt.deepspeed.profile='yes' (str) must be true or false"),
])
def test_invalid_deepspeed_options_fail_when_the_config_is_built(keys: dict, message: str) -> None:
    # In the launching process, when Hydra builds the callback: before any process starts.
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(layers="Block", deepspeed=keys)


@pytest.mark.parametrize("extra, message", [
    ({"segments": 2}, "ckpt.segments=2 cannot be combined with ckpt.deepspeed"),
    ({"offload": True}, "ckpt.offload=true cannot be combined with ckpt.deepspeed"),
    ({"preserve_rng_state": False}, "ckpt.preserve_rng_state=false cannot be combined with ckpt.deepspeed"),
])
def test_deepspeed_checkpoint_excludes_what_it_cannot_do(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(layers="Block", deepspeed={}, **extra)


def test_a_class_name_still_selects_blocks_that_fsdp2_has_sharded() -> None:
    from ckpt_plugin import apply_checkpointing

    model = nn.Sequential(Block(), Block())
    # fully_shard swaps each module's class for a subclass named FSDP<Name> (torch/distributed/fsdp).
    model[0].__class__ = type("FSDPBlock", (Block,), {})
    assert apply_checkpointing(model, layers="Block") == ["0", "1"]

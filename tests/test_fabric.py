"""The Python API on wrapped models: Lightning Fabric, DDP, FSDP (v1) and torch.compile, in any order.

``apply_checkpointing``, ``wrapped_modules`` and ``remove_checkpointing`` look
through the wrappers (``_compat.user_module``) and speak the user's own module
names (``blocks.0``, never ``_forward_module.module.blocks.0``). Each wrapper is
real: a Fabric on CPU, a gloo process group (one process here, two in the
``ddp`` run, which launches this file as a script), FSDP on CPU. Training
through the wrapper gives gradients bitwise equal to the same run without
checkpointing, and the checkpointed blocks really ran twice.

    python tests/test_fabric.py ddp OUT_DIR    # one 2-process Fabric DDP run (what the last test does)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import warm_python
from lightning.fabric import Fabric
from torch import nn

from ckpt_plugin import apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin._compat import user_module

BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)  # on: the recomputation must replay the same mask
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 16)
        self.calls += 1
        return x + self.drop(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def step(model: nn.Module, backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> dict[str, torch.Tensor]:
    """One training step on a fixed batch and dropout seed; the gradients, by the user's parameter names."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    backward(model(x).pow(2).mean())
    return {n: p.grad.clone() for n, p in user_module(model).named_parameters()}


def assert_bitwise_equal(plain: dict[str, torch.Tensor], ckpt: dict[str, torch.Tensor]) -> None:
    assert plain.keys() == ckpt.keys()
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name


def block_calls(model: nn.Module) -> list[int]:
    return [b.calls for b in user_module(model).blocks]


# ---------------------------------------------------------------------- Lightning Fabric

@pytest.fixture
def fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def test_fabric_module_names_are_the_users(fabric: Fabric) -> None:
    model = fabric.setup(net())
    assert "_forward_module.blocks.0" in dict(model.named_modules())  # what the wrapper's own names are
    assert apply_checkpointing(model, layers="blocks.*") == BLOCKS
    assert wrapped_modules(model) == wrapped_modules(model.module) == BLOCKS
    assert apply_checkpointing(model, layers="head") == ["head"]  # applying again replaces
    assert remove_checkpointing(model) == ["head"]
    assert wrapped_modules(model) == []


def test_fabric_training_step_is_bitwise_equal_to_no_checkpointing(fabric: Fabric) -> None:
    plain = fabric.setup(net())
    want = step(plain, fabric.backward)
    model = fabric.setup(net())
    assert apply_checkpointing(model, layers="blocks.*") == BLOCKS
    got = step(model, fabric.backward)
    assert_bitwise_equal(want, got)
    assert block_calls(plain) == [1, 1, 1] and block_calls(model) == [2, 2, 2]  # recomputed in backward


def test_fabric_with_an_optimizer_and_auto_layers(fabric: Fabric) -> None:
    inner = net()
    model, optimizer = fabric.setup(inner, torch.optim.SGD(inner.parameters(), lr=0.1))
    assert apply_checkpointing(model, layers="auto") == BLOCKS
    step(model, fabric.backward)
    optimizer.step()
    assert block_calls(model) == [2, 2, 2]


def test_compiled_and_fabric_nested_either_way(fabric: Fabric) -> None:
    inner = net()
    for model in (torch.compile(fabric.setup(inner)), fabric.setup(torch.compile(inner)),
                  torch.compile(fabric.setup(torch.compile(inner)))):
        assert user_module(model) is inner
        assert apply_checkpointing(model, layers="re:blocks\\.[02]") == ["blocks.0", "blocks.2"]
        assert wrapped_modules(model) == ["blocks.0", "blocks.2"]
        assert remove_checkpointing(model) == ["blocks.0", "blocks.2"]


def test_compiled_training_step_is_bitwise_equal_to_no_checkpointing() -> None:
    want = step(torch.compile(net(), backend="eager"))
    model = torch.compile(net(), backend="eager")
    assert apply_checkpointing(model, layers="Block") == BLOCKS
    assert_bitwise_equal(want, step(model))


# ---------------------------------------------------------------------- DDP and FSDP, one gloo process

@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_names_and_gradients(process_group: None) -> None:
    plain = nn.parallel.DistributedDataParallel(net())
    want = step(plain)
    model = nn.parallel.DistributedDataParallel(net())
    assert "module.blocks.0" in dict(model.named_modules())
    assert apply_checkpointing(model, layers="blocks.*") == wrapped_modules(model) == BLOCKS
    assert_bitwise_equal(want, step(model))
    assert block_calls(model) == [2, 2, 2]
    assert remove_checkpointing(model) == BLOCKS


def test_fsdp_root_names_and_gradients(process_group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    def fsdp() -> nn.Module:
        return FullyShardedDataParallel(net(), device_id=torch.device("cpu"), use_orig_params=True)

    want = step(fsdp())
    model = fsdp()
    assert "_fsdp_wrapped_module.blocks.0" in dict(model.named_modules())
    assert apply_checkpointing(model, layers="Block") == wrapped_modules(model) == BLOCKS
    assert_bitwise_equal(want, step(model))
    assert block_calls(model) == [2, 2, 2]


def test_compiled_ddp_inside_fabric_names(process_group: None, fabric: Fabric) -> None:
    inner = net()
    model = torch.compile(fabric.setup(nn.parallel.DistributedDataParallel(inner)))
    assert user_module(model) is inner
    assert apply_checkpointing(model, layers="blocks.1") == wrapped_modules(model) == ["blocks.1"]


# ---------------------------------------------------------------------- two processes: Fabric's own DDP

def _ddp_worker(out: Path) -> None:
    """Each rank: a step of the plain and the checkpointed model under Fabric DDP; its gradients to JSON."""
    from rank_exit import leave  # beside this file (a script's own folder is first on sys.path)

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", num_nodes=1)
    fabric.launch()
    result = {}
    for ckpt in (False, True):
        model = fabric.setup(net())
        assert isinstance(model._forward_module, nn.parallel.DistributedDataParallel)
        if ckpt:
            result["wrapped"] = apply_checkpointing(model, layers="blocks.*")
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1 + fabric.global_rank))  # a shard per rank
        torch.manual_seed(2)
        fabric.backward(model(x).pow(2).mean())  # DDP averages the gradients over both ranks
        result["ckpt" if ckpt else "plain"] = {n: p.grad.tolist() for n, p in model.module.named_parameters()}
        result[f"calls_{ckpt}"] = block_calls(model)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
    leave(fabric.global_rank, fabric.strategy.launcher.procs)  # rank 0 fails if rank 1 did


def test_fabric_ddp_two_processes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
    proc = warm_python.run([__file__, "ddp", str(tmp_path)], env=env, cwd=Path(__file__).parents[1], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["wrapped"] == BLOCKS
        assert rank["plain"] == rank["ckpt"]  # bitwise: floats written in full by json
        assert rank["calls_False"] == [1, 1, 1] and rank["calls_True"] == [2, 2, 2]
    assert ranks[0]["ckpt"] == ranks[1]["ckpt"]  # all-reduced: the same on both ranks


if __name__ == "__main__" and sys.argv[1:2] == ["ddp"]:
    _ddp_worker(Path(sys.argv[2]))

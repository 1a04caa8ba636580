"""Issue #33, item 4: a fixed mode that keeps more on a layer than no checkpointing keeps there is said at
apply time (a UserWarning naming the layer, its class and both byte counts, measured on fake tensors), and
ckpt=auto never chooses such a treatment."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ckpt_plugin import apply_checkpointing, make_config, remove_checkpointing
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.measure.overkeep import over_kept, overkeep_warning
from ckpt_plugin.planning.options import SELECTIVE, SELECTIVE_NB

torch_geometric = pytest.importorskip("torch_geometric")
B, W = 4, 8  # batch, width


class Fork(nn.Module):
    """Two linears whose outputs are added: no backward needs either output, ``matmuls`` saves both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class Mlp(nn.Module):
    """Linear, GELU, linear: without checkpointing it keeps x, h and gelu(h); ``matmuls`` keeps x and both outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.pre = nn.Linear(W, W)
        self.blocks = nn.ModuleList([block() for _ in range(2)])
        self.example_input_array = torch.randn(B, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for block in self.blocks:
            x = block(x)
        return x


class Sage(nn.Module):
    """PyG's GraphSAGE, tiny: 16 nodes, 3 layers, width 8; each SAGEConv adds lin_l(aggregated) and lin_r(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.gnn = torch_geometric.nn.GraphSAGE(W, W, num_layers=3)
        self.example_input_array = (torch.randn(16, W), torch.randint(0, 16, (2, 48)))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.gnn(x, edge_index)


def _applied_with_warning(model: nn.Module, layers: str, **keys: object) -> tuple[list[str], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = apply_checkpointing(model, layers=layers, **keys)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "keeps more" in str(w.message)]
    return names, said


def test_selective_on_a_fork_of_linears_warns_with_exact_bytes() -> None:
    torch.manual_seed(0)
    model = Stack(Fork)
    names, said = _applied_with_warning(model, "Fork", mode="selective", policy="matmuls")
    rows = over_kept(model, names, lambda: model(model.example_input_array))
    f32 = B * W * 4
    assert [(r.name, r.cls, r.kept_with, r.kept_without) for r in rows] == [
        ("blocks.0", "Fork", 3 * f32, f32),  # its input and both matmul outputs, against its input alone
        ("blocks.1", "Fork", 3 * f32, f32),
    ]
    assert said == [overkeep_warning(rows, "ckpt=selective")]
    assert said[0].startswith("ckpt=selective keeps more for backward than no checkpointing on 2 layer(s): "
                              "blocks.0 (Fork) keeps 384 bytes (384 B) where no checkpointing keeps 128 bytes "
                              "(128 B); blocks.1 (Fork)")
    remove_checkpointing(model)


@pytest.mark.parametrize("keys", [{"mode": "selective", "policy": "matmuls"}, {"mode": "full"}], ids=str)
def test_no_warning_where_checkpointing_keeps_less(keys: dict) -> None:
    torch.manual_seed(0)
    model = Stack(Mlp)
    names, said = _applied_with_warning(model, "Mlp", **keys)
    assert said == []
    assert over_kept(model, names, lambda: model(model.example_input_array)) == []
    remove_checkpointing(model)


def test_selective_on_graphsage_warns_naming_each_sageconv() -> None:
    torch.manual_seed(0)
    model = Sage()
    names, said = _applied_with_warning(model, "SAGEConv", mode="selective", policy="matmuls")
    rows = over_kept(model, names, lambda: model(*model.example_input_array))
    assert [(r.name, r.cls) for r in rows] == [(f"gnn.convs.{i}", "SAGEConv") for i in range(3)]
    assert all(r.kept_with > r.kept_without for r in rows)
    assert said == [overkeep_warning(rows, "ckpt=selective")]
    for r in rows:
        assert f"{r.name} (SAGEConv) keeps {r.kept_with:,} bytes" in said[0]
        assert f"no checkpointing keeps {r.kept_without:,} bytes" in said[0]
    remove_checkpointing(model)


def test_auto_never_chooses_the_over_keeping_treatment_on_graphsage() -> None:
    """selective keeps more than keep and recomputes: keep dominates it on the planner's frontier."""
    torch.manual_seed(0)
    model = Sage()
    chosen = set()
    for budget in ("min", 0.9, 0.85):  # min reaches 0.80 of the peak without
        plan = plan_for(model, make_config(mode="auto", layers="SAGEConv", budget=budget, timing="eager"))
        chosen |= set(getattr(plan.planned, "choices", {}).values())
    assert chosen and not chosen & {SELECTIVE, SELECTIVE_NB}

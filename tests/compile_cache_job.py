"""One compiled, checkpointed training step; prints inductor's and AOTAutograd's cache counters as JSON.

    python tests/compile_cache_job.py MODE      # MODE: selective, full, auto

Run by ``tests/test_compile_cache.py`` as two fresh processes sharing ``TORCHINDUCTOR_CACHE_DIR``;
the compiled gradients are checked against the same model run eagerly (float32's tolerance).
The blocks hold a BatchNorm, so every mode's checkpoint gets a context_fn (the policy's, or the
BatchNorm fix's): what the FX graph cache has to pickle to key the graph.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn
from torch._dynamo.utils import counters  # private: the test's only window on the cache

from ckpt_plugin import apply_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.norm(self.fc1(x))))


def main(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(8, 16)
    keys = {"selective": dict(mode="selective", policy="matmuls"), "full": dict(mode="full"),
            "auto": dict(mode="auto", budget=0.7)}[mode]
    if mode == "auto":
        model.example_input_array = x
    eager = copy.deepcopy(model)
    apply_checkpointing(model, layers="Block", **keys)
    apply_checkpointing(eager, layers="Block", **keys)
    torch.compile(model)(x).sum().backward()
    eager(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)  # inductor fuses: float32's tolerance, not bitwise
    print(json.dumps({k: dict(counters[k]) for k in ("inductor", "aot_autograd", "graph_break")}))


if __name__ == "__main__":
    main(sys.argv[1])

"""``ckpt=auto ckpt.budget=0.5`` on issue #33's families (``ckpt_tools/zoo/families.py``), and the table's columns.

``layers=auto`` on each of them (the classes chosen, exactly the library's own
units; the step bitwise; names kept; ``remove_checkpointing`` exact) is
``tests/test_zoo.py``'s, which runs every zoo entry. Here, one model per family
is planned by ``ckpt=auto`` at half the activation peak without checkpointing
from its own training call: the budget is met (ESM2, torchtune's Llama 3), or
refused naming the least reachable peak, and that peak, typed back as the
budget in bytes, is met (GAT); the step bitwise either way (x-transformers is
refused at 0.52 and meets it: ``python -m ckpt_tools.zoo --budget``, kept out
of the suite for its time). ESM2 (``padding_mask.any()``) and torch_geometric
(``nonzero`` in its message passing) read tensor values in their forward: planning
replays what one forward without autograd read (``ckpt_plugin/measure/values.py``).
"""

from __future__ import annotations

import re

import pytest
from zoo_budget import met_or_its_least

from ckpt_tools.zoo import all_models
from ckpt_tools.zoo.measure import _cache_off

ZOO = {entry.name: entry for entry in all_models()}
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second intra-op thread only waits (conftest)

# Both forwards read values (ESM's padding check, PyG's self-loop masks): planned by replaying what one forward
# without autograd read (measure/values.py).
@pytest.mark.parametrize("name, refused", [
    ("esm.esm2", False),
    ("pyg.gat", True),  # three small layers: the least reachable is 0.55 of none's
])
def test_auto_at_half_the_peak_is_met_or_its_least_is(name: str, refused: bool) -> None:
    entry = ZOO[name]
    result = met_or_its_least(entry, _cache_off(entry.build()), refused)
    assert result.met


def test_the_table_prints_units_ratios_and_the_budget(capsys: pytest.CaptureFixture) -> None:
    """``python -m ckpt_tools.zoo --budget torchtune.llama3``: auto's unit is torchtune's own
    (``TransformerSelfAttentionLayer``, what ``set_activation_checkpointing`` wraps), bitwise, as low as torchtune's
    own checkpointing; ``ckpt.budget=0.5`` met, with the step's whole peak and planning's beside it."""
    from ckpt_tools.zoo.__main__ import main

    assert main(["--budget", "torchtune.llama3"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("torchtune.llama3"))
    cells = row.split()
    assert cells[1:6] == ["torchtune", "TransformerSelfAttentionLayer", "=", "2", "yes"]  # units, wrapped, bitwise
    sizes = re.findall(r"([\d.]+) (B|KiB|MiB)", row)
    assert len(sizes) == 6  # none, ours, own, floor, the step's whole peak, planning's (RSS growth: may be 0 B)
    none, ours, own = (float(n) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[u] for n, u in sizes[:3])
    assert ours == own < none  # the same two layers checkpointed: the same peak, printed rounded
    assert row.endswith("  met") and float(cells[-6]) <= 0.5  # ckpt.budget=0.5: the step's /none, then the outcome
    assert "auto chose the library's own units on 1 of 1" in out
    assert "ckpt=auto ckpt.budget=0.5: met on 1 of 1; refused with a reachable least on 0" in out

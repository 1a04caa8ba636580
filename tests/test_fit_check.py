"""``python -m ckpt_tools.fit_check``: ckpt.memory's plan, installed, runs a real whole step within its limit and as
predicted; ckpt.batch=max's batch (found on fake tensors) is the one real steps at every size find.

One run of the tool's ``main`` in this process (the quick GPT, the middle limit, the batch search), its JSON read.
Bytes are exact (MemTracker on real tensors against the prediction on fake ones); timings are never asserted.
"""

from __future__ import annotations

import json

import pytest

from ckpt_tools.fit_check import TOLERANCE, main


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    out = tmp_path_factory.mktemp("fit") / "fit.json"
    status = main(["--quick", "--models", "gpt", "--fractions", "0.5", "--batch", "--out", str(out)])
    return status, json.loads(out.read_text())


def test_the_plan_fits_its_limit_as_predicted(checked) -> None:
    _, found = checked
    assert [(r["model"], r["optimizer"], r["fraction"]) for r in found["limits"]] == [("gpt", "adamw", 0.5)]
    for row in found["limits"]:
        assert row["measured"] <= row["limit"], row
        assert abs(row["predicted"] / row["measured"] - 1) <= TOLERANCE, row
        assert row["fits"] and row["within"], row
    step = found["steps"][0]
    assert step["wmin"] < found["limits"][0]["limit"] < step["w0"]  # the middle limit needs checkpointing


def test_the_batch_search_finds_what_real_steps_find(checked) -> None:
    status, found = checked
    [row] = found["batch"]
    real = {int(b): peak for b, peak in row["real"].items()}
    # Exhaustive: every size from 1 fits up to the one found, the next does not (a real step each).
    assert all(real[b] <= row["limit"] for b in range(1, row["exhaustive"] + 1)), row
    assert real[row["exhaustive"] + 1] > row["limit"], row
    assert row["chosen"] == row["exhaustive"], row
    assert status == 0

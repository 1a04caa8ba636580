"""The plugin never spends the memory it exists to save: the whole process's peak, as a user feels it.

One training step of the example GPT, run as a user runs it (``recipes/train.py``
in a subprocess), with the fit-start report on and ``example_input_array`` at the
real batch. Its peak resident memory (``ru_maxrss`` of the process, printed at
exit) must be about that of the same step whose report runs on a batch-1 example:
before the report counted on fake tensors, the un-checkpointed forward it ran
added the whole activation memory of the batch (issue #12: 3.89 GB against
1.65 GB at batch 32). ``ckpt=auto`` profiles on fake tensors too, so its process
stays close to ``ckpt=full``'s (it was above ``ckpt=none``'s).

The model is sized so that activations without checkpointing (about 1 GiB at
batch 32) dwarf the slack allowed; the bounds are ratios of peaks, not timings.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import run_recipe

# Four blocks of width 256 over 256 tokens at batch 32: ~0.95 GiB of activations without checkpointing.
GPT_AT_32 = ["model.n_layer=4", "data.batch_size=32", "trainer.max_steps=1", "trainer.enable_progress_bar=false",
             "trainer.enable_model_summary=false"]


RUNS = [("ckpt=full",), ("ckpt=full", "model.batch_size=1"), ("ckpt=auto", "ckpt.budget=0.35"), ("ckpt=none",)]


@pytest.fixture(scope="module")
def peak_kib(tmp_path_factory):
    """The process peak (KiB) of the recipe with these overrides; the four runs start together, two at a
    time (each is a process of its own, so its peak is its own; half of each run is single-threaded imports)."""
    dirs = {overrides: tmp_path_factory.mktemp("run") for overrides in RUNS}  # here: the factory is not thread-safe

    def measure(overrides: tuple[str, ...]) -> int:
        proc = run_recipe(*GPT_AT_32, *overrides, tmp_path=dirs[overrides], peak=True)
        found = re.findall(r"^max_rss_kib (\d+)$", proc.stdout, flags=re.MULTILINE)
        assert found, proc.stdout[-2000:]
        return int(found[-1])

    with ThreadPoolExecutor(2) as pool:
        futures = {overrides: pool.submit(measure, overrides) for overrides in RUNS}
        yield lambda *overrides: futures[overrides].result()


def test_report_at_the_real_batch_costs_what_a_batch_1_report_costs(peak_kib):
    at_32, at_1 = peak_kib("ckpt=full"), peak_kib("ckpt=full", "model.batch_size=1")
    # The un-checkpointed forward at batch 32 alone would add ~1 GiB (about 100 % of at_1). The margin is for the
    # process's own spread: the same two runs measured 1.00 to 1.11 of each other across fresh-clone CI runs.
    assert at_32 <= 1.25 * at_1, (at_32, at_1)


def test_auto_profiles_without_the_memory_of_the_step_it_avoids(peak_kib):
    full, auto, none = peak_kib("ckpt=full"), peak_kib("ckpt=auto", "ckpt.budget=0.35"), peak_kib("ckpt=none")
    assert auto <= 1.25 * full, (auto, full)  # the step auto avoids would add ~100 %; the spread is up to 11 %
    assert auto < none, (auto, none)

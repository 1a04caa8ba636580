"""Inductor's compile cache works with every mode (issue #22, point 1).

The same compiled, checkpointed step runs in two fresh processes sharing one
cache directory: the second finds every graph in inductor's FX graph cache
(its counters say so), and neither logs a pickling failure. The policy's
context_fn is a ``functools.partial`` of a module-level function that pickles
as the policy's description (``engine/treatment.py``); a closure made the
cache give up on every graph ("Failed to pickle cache key").
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import warm_python

JOB = Path(__file__).with_name("compile_cache_job.py")


def _run(mode: str, cache: Path, cwd: Path) -> tuple[dict, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(JOB.parent.parent)}
    proc = warm_python.run([str(JOB), mode], cwd=cwd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_second_process_hits_the_fx_graph_cache(tmp_path: Path) -> None:
    # selective over blocks holding a BatchNorm: a context_fn with the policy and the BatchNorm fix,
    # all that full, offload and auto's layers install too.
    modes = ["selective"]
    with ThreadPoolExecutor(len(modes)) as pool:
        first = dict(zip(modes, pool.map(lambda m: _run(m, tmp_path / m, tmp_path), modes)))
        second = dict(zip(modes, pool.map(lambda m: _run(m, tmp_path / m, tmp_path), modes)))
    for mode in modes:
        (before, before_log), (after, after_log) = first[mode], second[mode]
        assert before["graph_break"] == {}, mode  # the checkpoint compiled as one region, not run eagerly
        assert before["inductor"].get("fxgraph_cache_miss", 0) >= 2, mode  # forward and backward compiled ...
        assert before["inductor"].get("fxgraph_cache_hit", 0) == 0, mode
        assert after["inductor"].get("fxgraph_cache_hit", 0) == before["inductor"]["fxgraph_cache_miss"], mode
        assert after["inductor"].get("fxgraph_cache_miss", 0) == 0, mode  # ... and found again
        for log in (before_log, after_log):  # no pickling failure of ours: the closure's was "Can't pickle local object"
            assert not _our_pickling_failures(log), (mode, _our_pickling_failures(log))


def _our_pickling_failures(log: str) -> list[str]:
    """The log's pickling failures that name the plugin or a local object (a closure of ours).

    torch 2.11 and 2.12 also log "Failed to pickle cache key" for AOTAutograd's cache key of a selective
    region, which holds the aten OpOverloads of torch's own selective-checkpoint policy (``aten.bmm.dtype``):
    their pickler has no reducer for them. torch 2.13 and 2.15 bypass that cache for the same key without a
    pickling message. The FX graph cache, which the counts above check, hits on every release.
    """
    failures = [line for line in log.splitlines() if "pickle" in line.lower()]
    return [line for line in failures if "ckpt_plugin" in line or "local object" in line.lower()]

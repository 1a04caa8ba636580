"""One plan on every rank: two DDP processes (gloo, CPU) whose layer timings disagree install rank 0's plan.

One launch of tests/plan_agreement_worker.py (~20 s on 2 cores): each rank first plans alone (rank 1
would choose otherwise than rank 0: the test could fail), then one ckpt=auto fit of one step, in which
rank 0 plans and both install its plan. The step's gradients, after DDP's all-reduce, are bitwise those
of one process without checkpointing on the same two batches: DDP scales each rank's gradient by 1/2
(exact: a power of two) and gloo adds the two, which is what the reference does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import warm_python

WORKER = Path(__file__).with_name("plan_agreement_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict], str]:
    out = tmp_path_factory.mktemp("agreement")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = warm_python.run_ranks([str(WORKER), str(out / "run")], 2, env=env, cwd=out, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    run = out / "run"
    return ([json.loads((run / f"rank{r}.json").read_text()) for r in range(2)],
            [torch.load(run / f"rank{r}.pt", weights_only=True) for r in range(2)], output)


def test_every_rank_installs_rank_zeros_plan_though_their_timings_disagree(ranks) -> None:
    results, _, output = ranks
    zero, one = results
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["own_choices"] != one["own_choices"]  # alone, rank 1 would have planned otherwise
    assert zero["choices"] == one["choices"] == zero["own_choices"]  # both install rank 0's
    assert zero["wrapped"] == one["wrapped"] and zero["installed"] == one["installed"] and zero["wrapped"]
    assert zero["plan"] == one["plan"]  # what each keeps in its checkpoint state
    assert "ckpt=auto: rank 0 measures the candidate layers" in output  # DDP: the other rank waits
    saved = json.loads(Path(zero["plan_path"]).read_text())  # rank 0 wrote it, for ckpt.plan
    assert saved == zero["plan"] and one["plan_path"] is None


@pytest.mark.usefixtures("one_thread")  # as the ranks ran (OMP_NUM_THREADS=1): the same reduction order
def test_the_steps_gradients_are_bitwise_one_process_without_checkpointing(ranks) -> None:
    from plan_agreement_worker import model

    _, tensors, _ = ranks
    assert tensors[0]["grads"].keys() == tensors[1]["grads"].keys()
    assert all(torch.equal(tensors[0]["grads"][n], g) for n, g in tensors[1]["grads"].items())
    reference = model()  # the same weights, no checkpointing, one process
    grads = []
    for rank in range(2):
        reference.zero_grad(set_to_none=True)
        reference.loss(tensors[rank]["batch"]).backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    assert not torch.equal(tensors[0]["batch"][0], tensors[1]["batch"][0])  # each rank its own batch
    for name, grad in tensors[0]["grads"].items():
        assert torch.equal(grad, grads[0][name] * 0.5 + grads[1][name] * 0.5), name

"""What ``Preemption`` costs per optimizer step: its one ``all_gather`` of one int per rank.

    python -m ckpt_tools.preemption_cost                 # 2 CPU processes (gloo), 2000 steps
    python -m ckpt_tools.preemption_cost --world 4 --steps 5000

Starts ``--world`` processes in one process group and times ``Preemption._gather``,
the check every rank makes at every step boundary, exactly as the callback calls it
(on GPU machines: nccl and the rank's GPU with ``--backend nccl``). Prints the
median and the 99th percentile in microseconds; compare them with your step time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_plugin.runs.preemption import Preemption


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, steps: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=device))
    callback = Preemption()
    callback._signal = callback.requeue_signal or callback._default_signal(None)
    times = []
    for step in range(steps + 50):
        start = time.perf_counter()
        received = callback._gather(trainer)
        if step >= 50:  # the first calls set up the collective
            times.append(time.perf_counter() - start)
        assert received == [0] * world
    if rank == 0:
        results["times"] = times
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args(argv)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.world, _free_port(), args.backend, args.steps, results), nprocs=args.world)
        times = sorted(results["times"])
    median, p99 = statistics.median(times) * 1e6, times[int(0.99 * len(times))] * 1e6
    print(f"Preemption's per-step check, {args.world} ranks, {args.backend}, {args.steps} steps: "
          f"median {median:.0f} us, p99 {p99:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()

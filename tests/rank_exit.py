"""How a multi-process test script ends once every rank has written its results.

    leave(rank, launcher.procs)    # never returns; rank 0's exit code is 1 if a rank it launched failed

Both ranks meet at a barrier, so neither needs the process group any more. Rank 0, which hosts the
group's store and launched the other ranks (Lightning's ``_SubprocessScriptLauncher`` keeps their
``Popen`` objects), waits for them and fails if one did. Then each process leaves with ``os._exit``
and never tears gloo down: ``destroy_process_group`` can hang (pytorch#75097: CI once waited 300 s in
tests/test_fabric.py after the barrier, 2026-11-27), and a group left alive can abort the interpreter
at exit instead ("terminate called without an active exception", pytorch PR 179291). The results are
on disk by then; what a test checks is not the teardown of torch's process groups.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch.distributed as dist

__all__ = ["leave"]


def leave(global_rank: int, children: Sequence[subprocess.Popen], timeout: float = 120) -> NoReturn:
    """Barrier; rank 0 waits for ``children`` (the ranks it launched); every rank exits with ``os._exit``."""
    dist.barrier()
    code = 0
    if global_rank == 0:
        codes = [child.wait(timeout=timeout) for child in children]
        if any(codes):
            print(f"a launched rank failed: exit codes {codes}", file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

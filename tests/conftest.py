"""Shared pieces: small example models, the recipe as a subprocess, Hydra composition."""

from __future__ import annotations

import functools
import operator
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

# The suite runs on the CPU, GPU or not, as CI does: the GPUs are hidden for the whole process before anything
# initialises CUDA (which reads CUDA_VISIBLE_DEVICES once, at its first call: hidden and shown again per test, the
# CUDA tests of the GPU check failed with "No CUDA GPUs are available" once any test before them had touched it).
# The GPU check runs the tests that need CUDA in a process of their own with CKPT_TEST_CUDA=1.
if os.environ.get("CKPT_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402
import warm_python  # noqa: E402

import ckpt_tools  # noqa: F401  (before Lightning: lets the CUDA torchvision import, ckpt_tools/torchvision_cpu.py)
from hydra import compose, initialize_config_dir

from ckpt_plugin.config.hydra import register_configs
from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet
from recipes.train import train  # noqa: F401  (also registers the recipe's resolver, as running it does)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The README's command runs the suite in two processes (pytest -n 2) on two cores: each runs torch on
    # one thread, and so does every process a test starts (OMP_NUM_THREADS is inherited). Two threads in
    # each of two workers would oversubscribe the cores: measured, 8 min 44 s that way, 5 min 28 s this way,
    # against 8 min 48 s in one process with torch's two threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
# Every interpreter a test starts imports ckpt_tools first (tests/startup/sitecustomize.py), as this one has:
# the test environment's torchvision imports only so (ckpt_tools/torchvision_cpu.py).
STARTUP = ROOT / "tests" / "startup"
os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP), *filter(None, [os.environ.get("PYTHONPATH")])])
CONFIGS = ROOT / "recipes" / "configs"  # the recipe's own: train.yaml, trainer, callbacks/model_checkpoint
RECIPE = ROOT / "recipes" / "train.py"
# Where each config group lives: the plugin ships only ckpt and callbacks/activation_checkpointing;
# the example model and data groups ship with ckpt_examples; the rest is the recipe's.
GROUP_DIRS = {
    "ckpt": ROOT / "ckpt_plugin" / "config" / "ckpt",
    "model": ROOT / "ckpt_examples" / "configs" / "model",
    "data": ROOT / "ckpt_examples" / "configs" / "data",
    "trainer": CONFIGS / "trainer",
}

# Small enough that a subprocess run of the recipe takes seconds.
TINY_GPT = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "data.batch_size=4"]
TINY_RESNET = ["model=resnet", "model.channels=16", "data.image_size=16", "data.batch_size=8"]
FAST = ["trainer.max_steps=2", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def small_gpt(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    kwargs = dict(n_layer=4, n_embd=32, n_head=2, block_size=16, dropout=0.1, batch_size=2) | overrides
    return GPT(**kwargs).to(dtype)


def small_resnet(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> ResNet:
    torch.manual_seed(seed)
    kwargs = dict(channels=16, depths=(2, 2), image_size=8, dropout=0.1, batch_size=4) | overrides
    return ResNet(**kwargs).to(dtype)


def added_in_order(seconds: Iterable[float]) -> float:
    """``seconds`` added one at a time from the left, from 0.0: the planners' arithmetic (planning/planner.py's and
    planning/inside.py's frontiers grow a total layer by layer, part by part).

    An exhaustive search that must match a plan's seconds exactly adds this way, not with ``sum()``: from Python
    3.12 on, ``sum()`` of floats compensates the rounding (cpython gh-100425) and can differ from the planner's
    total in the last digit (tests/test_auto.py's random profiles did, on the GPU machine's Python 3.12).
    """
    return functools.reduce(operator.add, seconds, 0.0)


def gpt_batch(model: GPT, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T, V = model.hparams.block_size, model.hparams.vocab_size
    return torch.randint(V, (batch, T), generator=g), torch.randint(V, (batch, T), generator=g)


def resnet_batch(model: ResNet, batch: int = 4, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = model.hparams.image_size
    return torch.randn(batch, 3, s, s, generator=g).to(dtype), torch.randint(10, (batch,), generator=g)


# Runs the recipe as its own __main__ and prints the process's peak resident memory as it exits.
_PRINT_PEAK = (
    "import atexit, resource, runpy, sys; "
    "atexit.register(lambda: print('max_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_recipe(*overrides: str, tmp_path: Path, check: bool = True, peak: bool = False) -> subprocess.CompletedProcess:
    """Run ``recipes/train.py`` as a user would, in a process of its own; output dir under ``tmp_path``.

    The process is a fork of one that has imported torch, Lightning and Hydra already (``warm_python``).

    ``peak=True``: the last line of stdout is ``max_rss_kib N``, the process's peak resident memory.
    """
    args = [str(RECIPE), f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    if peak:  # the process's own memory: a new interpreter, not a fork of one that imported everything
        cmd = [sys.executable, "-c", _PRINT_PEAK, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    else:
        cmd = [sys.executable, *args]
        proc = warm_python.run(args, cwd=tmp_path, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def compose_train(*overrides: str):
    """Compose ``recipes/configs/train.yaml`` in-process with Hydra, as the recipe does."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def compiled_backward_bytes(loss: torch.Tensor, model: torch.nn.Module) -> tuple[int, int]:
    """(bytes, nodes): the unique storages of every ``CompiledFunctionBackward``'s ``saved_tensors``
    behind ``loss``, parameters and buffers excluded; what compiled graphs keep, read off autograd."""
    from ckpt_plugin._compat import storage_key

    state = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    seen, total, nodes = set(), 0, 0
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            nodes += 1
            for t in node.saved_tensors:
                if (key := storage_key(t)) not in state and key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return total, nodes


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: on a shared 2-core machine a second intra-op thread only adds waiting
    (~8 ms per op to wake it). Bytes and FLOPs do not change."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The files that take longest (seconds in one process on 2 cores, 2026-11-26), run first: under
# `pytest -n 2 --dist loadfile` each worker takes the next file when it is done, so a long file left
# for last would run alone on one core at the end while the other waits.
SLOWEST_FIRST = ("test_slurm.py", "test_strategies.py", "test_process_memory.py", "test_resume.py",
                 "test_properties.py", "test_zoo.py", "test_wheel.py",
                 "test_zoo_libraries.py")  # ~100 s of CPU on one thread (2026-11-29): planning e3nn's and CoCa's steps


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the other files, and every file's tests, keep their order

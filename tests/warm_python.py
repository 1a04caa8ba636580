"""Run a Python script as its own process without paying its imports again: ``python script args`` for tests.

    proc = warm_python.run([str(RECIPE), "ckpt=none"], cwd=tmp, env=env, timeout=600)  # a CompletedProcess
    proc = warm_python.run(["-m", "ckpt_tools.bench", "--quick"], cwd=tmp, env=env, timeout=300)
    proc = warm_python.run_ranks([str(WORKER), str(out)], 2, cwd=tmp, env=env, timeout=600)  # both ranks warm

A fresh interpreter spends ~3.5 s on these 2-core machines importing torch, Lightning (with
torchmetrics, transformers and matplotlib under it) and Hydra before a tiny recipe run does ~1 s
of work. Here a server process imports them once (multiprocessing's forkserver, which forks from a
single-threaded process) and every run is a fork of it: a new process with its own pid, working
directory, environment, ``sys.argv``, ``sys.path`` (the script's folder first, as the interpreter
sets it, then ``PYTHONPATH``, then the installed packages: nothing of pytest's), stdout and stderr
captured from its file descriptors, and the script executed as ``__main__``. The exit code is the
script's (``SystemExit``, an uncaught exception: 1 with the traceback on stderr).

What a fork shares is only the third-party imports (and ``ckpt_tools``'s package, whose import lets
the registry's CUDA torchvision import on the CPU torch); our modules are imported by the run itself.
Tests about what a command imports, about the process's memory, or about signals sent to a
process group start a real interpreter (``subprocess``) instead.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

__all__ = ["run", "run_ranks"]

# ckpt_tools first: importing it lets the registry's CUDA torchvision import on the CPU torch (torchvision_cpu.py),
# before lightning.pytorch imports it through torchmetrics.
PRELOAD = ["ckpt_tools", "torch", "lightning.pytorch", "hydra", "hydra.main", "omegaconf"]
_LOCK = threading.Lock()


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """``sys.path`` of a fresh ``python`` without ``PYTHONPATH``, its first entry (the script's folder) left out."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


def _main(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, path: list[str], status: str) -> None:
    """The child: become ``python *argv`` in ``cwd`` with ``env``, then exit with the script's code."""
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        os.dup2(os.open(name, flags), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    sys.path[:] = path
    if env.get("OMP_NUM_THREADS", "").isdigit():  # torch read it when the server imported it: say it again
        # Imported here if the server's preload did not (multiprocessing passes over a preload's ImportError
        # silently: once in a full suite run, a server came up without torch and every run in it failed).
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    multiprocessing.current_process().name = "MainProcess"  # what the script would see as a program of its own
    code: int | str | None = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # runpy puts the module's file in sys.argv[0], as python -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # the interpreter's shutdown (os._exit skips it): atexit handlers, then the streams
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    exit_code = code if isinstance(code, int) else (0 if code is None else 1)
    Path(status).write_text(str(exit_code))  # read by run(): the server may not live to pass it on
    os._exit(exit_code)


def run(argv: list[str], *, cwd: Path | str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` (a script and its arguments, or ``-m module ...``) as a fork of the warm server;
    its output and exit code."""
    return _forks(argv, [env], cwd, timeout)


def run_ranks(argv: list[str], world: int, *, cwd: Path | str, env: dict[str, str],
              timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` once per rank of a ``world``-process job on this machine, every rank a fork of the warm
    server: each with ``LOCAL_RANK``, ``NODE_RANK=0`` and one ``MASTER_ADDR``/``MASTER_PORT``, as ``torchrun``
    starts them, so Lightning (and Fabric) see processes created outside and launch none of their own (their
    launcher would start the other ranks as new interpreters, each paying the imports again). Their outputs in
    rank order; the exit code the first nonzero one, else 0."""
    with contextlib.closing(socket.socket()) as sock:  # a free port for the group's store, as Lightning finds one
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    return _forks(argv, [env | job | {"LOCAL_RANK": str(rank)} for rank in range(world)], cwd, timeout)


def _forks(argv: list[str], envs: list[dict[str, str]], cwd: Path | str, timeout: float) -> subprocess.CompletedProcess:
    """One fork of the warm server per environment in ``envs``, each running ``python *argv``."""
    if argv[0] == "-m":  # python -m: the working directory first on sys.path
        first = os.path.abspath(cwd)
    else:
        argv = [os.path.abspath(os.path.join(cwd, argv[0])), *argv[1:]]
        first = os.path.dirname(argv[0])
    pythonpath = [p for p in envs[0].get("PYTHONPATH", "").split(os.pathsep) if p]
    path = [first, *pythonpath, *_interpreter_path()]
    with tempfile.TemporaryDirectory(prefix="warm-python-") as tmp:
        files = [tuple(os.path.join(tmp, f"{name}{i}") for name in ("stdout", "stderr", "status"))
                 for i in range(len(envs))]
        children = []
        for out, err, _ in files:
            Path(out).touch()
            Path(err).touch()
        with _LOCK:  # one request at a time to the server (it serves them in order anyway)
            for env, (out, err, status) in zip(envs, files, strict=True):
                child = _context().Process(target=_main, args=(list(argv), str(cwd), dict(env), out, err, path,
                                                               status))
                child.start()
                children.append(child)
        deadline = time.monotonic() + timeout
        for child in children:
            child.join(max(deadline - time.monotonic(), 0))
        if any(child.exitcode is None for child in children):
            for child in children:
                child.kill()
                child.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        codes = []
        for child, (_, _, status) in zip(children, files, strict=True):
            # The exit code as the run wrote it: multiprocessing answers 255 for a forkserver child whose status
            # the server could not pass on (popen_forkserver.poll: EOF on its socket), seen once in a full suite
            # run after a recipe had trained to its end. A run killed before it wrote one: the code as reported.
            written = Path(status).read_text() if os.path.exists(status) else ""
            codes.append(int(written) if written.strip().lstrip("-").isdigit() else child.exitcode)
        code = next((c for c in codes if c), 0)
        out = "".join(Path(f[0]).read_text() for f in files)
        err = "".join(Path(f[1]).read_text() for f in files)
        return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)

"""Run a Python script as its own process without paying its imports again: ``python script args`` for tests.

    proc = warm_python.run([str(RECIPE), "ckpt=none"], cwd=tmp, env=env, timeout=600)  # a CompletedProcess
    proc = warm_python.run(["-m", "ckpt_tools.bench", "--quick"], cwd=tmp, env=env, timeout=300)

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
import functools
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

__all__ = ["run"]

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
    if argv[0] == "-m":  # python -m: the working directory first on sys.path
        first = os.path.abspath(cwd)
    else:
        argv = [os.path.abspath(os.path.join(cwd, argv[0])), *argv[1:]]
        first = os.path.dirname(argv[0])
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = [first, *pythonpath, *_interpreter_path()]
    with tempfile.TemporaryDirectory(prefix="warm-python-") as tmp:
        out, err, status = (os.path.join(tmp, name) for name in ("stdout", "stderr", "status"))
        Path(out).touch()
        Path(err).touch()
        with _LOCK:  # one request at a time to the server (it serves them in order anyway)
            child = _context().Process(target=_main, args=(list(argv), str(cwd), dict(env), out, err, path, status))
            child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        # The exit code as the run wrote it: multiprocessing answers 255 for a forkserver child whose status
        # the server could not pass on (popen_forkserver.poll: EOF on its socket), seen once in a full suite
        # run after a recipe had trained to its end. A run killed before it wrote one: the exit code as reported.
        written = Path(status).read_text() if os.path.exists(status) else ""
        code = int(written) if written.strip().lstrip("-").isdigit() else child.exitcode
        return subprocess.CompletedProcess([sys.executable, *argv], code, Path(out).read_text(), Path(err).read_text())

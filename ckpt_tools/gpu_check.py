"""A GPU check in one command: the CUDA-only tests, a core subset and ``ckpt-bench`` on the GPU, in minutes.

The GPU machines within reach run their own torch and Lightning, lack hydra-core,
omegaconf and torchdata, and reach no package registry (DESIGN.md, environment
facts). So the check carries small pure-Python wheels for what they lack. Here,
with network, once (``.whl/`` is git-ignored: it travels only when carried)::

    python -m ckpt_tools.gpu_check --fetch-wheels .whl

On the GPU machine, from the repository root (the project is not installed there;
``.whl`` carried beside the working tree), at most 10 minutes::

    python3 -m ckpt_tools.gpu_check --wheels .whl --out $OUT

Anywhere, on CPU, tiny sizes and a seconds-long test subset (CI, and
``tests/test_gpu_check.py``)::

    python -m ckpt_tools.gpu_check --dry-run --out /tmp/gpu_check

Each step runs in a process of its own with its own time limit (and all of them
within ``--deadline``), its output captured into a log; a failed step is reported
and the next one runs. The steps: the wheels installed into ``--site`` (put first on
the path, then the repository root, for every step); the environment (torch, CUDA
device, Lightning, Python); pinned host <-> device copy bandwidth; the tests that skip
without CUDA (found by :func:`cuda_tests`); ``ckpt-bench`` on the example GPT at a
size that keeps a GPU busy (:data:`GPU_GPT`, bf16-mixed) for ``none``, ``full``,
``selective`` and ``offload``; ``ckpt-bench --offload`` (:data:`OFFLOAD_BUDGET`: offload's
pool, overlap and planning, issue #41); ``ckpt.memory`` with ``ckpt.batch=max`` (``bench fit``)
and under Lightning's FSDP and FSDP2 on the one GPU (``fsdp fit``: :data:`FSDP_FIT`, :data:`FSDP2_FIT`); then ``auto`` at 0.5
in a run of its own (planning on a new machine may be slow: it must not cost the others); last, with what is left of
the deadline, a core subset of CPU tests (:data:`CORE_TESTS`) on that torch.
Offload's overlap is read off the bench: its step time against ``none``'s and the
bytes the forward leaves on the device, against the time the moved bytes take to
copy at the measured bandwidth.

Into ``--out`` (at most 8 files): ``summary.md`` (every table), ``results.json``,
``setup.log``, ``tests.log``, ``bench.log`` and the bench's ``plot.png`` where it drew one.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ckpt_tools import gpu_summary
from ckpt_tools.gpu_steps import Check, Step
from ckpt_tools.gpu_summary import offload_overlap
from ckpt_tools.gpu_summary import skip_reasons as _skip_reasons

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "test.lock"
# What the package needs (pyproject's dependencies) that the GPU machines lack: torch, lightning, numpy and tqdm
# are theirs. torchdata's own requirements (requests, urllib3) are not imported by the StatefulDataLoader we use.
WHEELS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "torchdata")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "any")  # the GPU machines: x86-64, Python 3.12

# The core subset: the engine, policies, segments, offload's copy path, scan, measuring, auto's planner and
# Hydra composition (proves the carried wheels), none needing what the GPU machines lack (hypothesis,
# deepspeed, jsonargparse, transformers >= 5.23). CPU tests: they show the package works on that torch.
CORE_TESTS = ("tests/test_api.py", "tests/test_correctness.py", "tests/test_policies.py", "tests/test_segments.py",
              "tests/test_memory_flops.py", "tests/test_compat.py", "tests/test_offload.py", "tests/test_scan.py",
              "tests/test_offload_pool.py", "tests/test_offload_plan.py",
              "tests/test_auto.py", "tests/test_hydra.py",
              # private checkpoint internals read by frame (measure/values.py) and re-raised (_compat/checkpoint.py)
              "tests/test_values.py", "tests/test_wrapped_exceptions.py")
# --dry-run: the core API on a small GPT, about a second of tests (pytest's start-up costs more).
DRY_TESTS = tuple(f"tests/test_api.py::test_{name}" for name in (
    "apply_returns_the_wrapped_names_in_model_order", "wrapped_model_still_gives_the_same_output",
    "state_dict_and_parameter_names_unchanged", "remove_restores_the_model_exactly",
    "applying_twice_never_wraps_twice"))

# The example GPT at a size that keeps an H100 busy and fits 80 GB without checkpointing, bf16-mixed:
# 805 M parameters (3.2 GB fp32, as many for gradients), ~1.4 GB of saved activations per block at
# 16 x 1024 tokens (~22 GB in all); four models stay resident for the interleaved timing (~13 GB).
GPU_GPT = "n_layer=16,n_embd=2048,n_head=16,block_size=1024,batch_size=16"
DRY_GPT = "n_layer=2,n_embd=32,n_head=2,block_size=32,batch_size=2"
BENCH_MODES = ("none", "full", "selective", "offload")
AUTO_MODES = ("auto_0.5",)
TABLE_MODES = (*BENCH_MODES, *AUTO_MODES)

# Seconds per step, each also cut to what is left of --deadline (the whole check's limit).
LIMITS = {"install": 60, "env": 60, "bandwidth": 60, "cuda tests": 120, "bench": 200, "bench auto": 150,
          "bench fit": 150, "bench offload": 280, "fsdp fit": 200, "core tests": 150, "tests": 150}
# ckpt.memory with ckpt.batch=max on the GPU (issue #34): halfway between the least whole step and none's, a GPT
# a quarter of GPU_GPT's depth (the chosen batch runs without checkpointing too, for samples per second).
FIT_GPT = "n_layer=4,n_embd=2048,n_head=16,block_size=1024,batch_size=8"
FIT = "0.5"
# ckpt.memory under Lightning's own FSDPStrategy on one GPU (tests/fit_fsdp_worker.py --cuda): the twin's CUDA path,
# its prediction against MemTracker and the allocator. ~50 M parameters, 8 x 1024 tokens, bf16-mixed, AdamW; the
# limit between the least whole step (~1.2 GB, estimated) and none's (~5 GB).
FSDP_FIT = {"name": "fsdp", "optimizer": "adamw", "memory": "2.5GiB", "precision": "bf16-mixed", "data_batch": 8,
            "gpt": {"n_layer": 4, "n_embd": 1024, "n_head": 16, "block_size": 1024}}
# The same GPT under FSDP2 (ModelParallelStrategy, a world of one: the example's configure_model runs fully_shard on
# the twin's mesh of fake groups) with ckpt.memory=device (issue #43): the allocator's peak against the device.
FSDP2_FIT = {**FSDP_FIT, "name": "fsdp2", "strategy": "fsdp2", "memory": "device"}
# Offload that hides (issue #41): ckpt-bench --offload at this budget on GPU_GPT: every block offloaded against none
# (the pool's host allocations per step, the copies' share hidden), the blocks ckpt=auto offloads there, and
# ckpt=auto with and without offload at that memory, predicted against measured.
OFFLOAD_BUDGET = "0.25"
DRY_OFFLOAD_BUDGET = "0.5"  # the dry run's tiny GPT: 0.25 is below the least peak any plan reaches there
MiB = 2**20
CUDA_TESTS = "cuda tests"  # the step that runs the tests needing CUDA, with the GPUs shown to them

_ENV = r"""
import importlib.metadata as md, importlib.util, json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
import torch
info |= {"torch": torch.__version__, "torch cuda": torch.version.cuda, "cuda available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info |= {"device": torch.cuda.get_device_name(0), "device memory (GiB)": round(p.total_memory / 2**30, 1),
             "capability": f"{p.major}.{p.minor}", "devices": torch.cuda.device_count()}
# Versions from the distributions' metadata (importing transformers or matplotlib costs seconds).
for name in ("lightning", "pytorch-lightning", "hydra-core", "omegaconf", "antlr4-python3-runtime", "torchdata",
             "transformers", "matplotlib", "pytest", "pytest-xdist"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = "missing"
for name in ("ckpt_plugin", "hydra_plugins.ckpt_plugin_searchpath"):  # from the checkout, not installed there
    spec = importlib.util.find_spec(name)
    info[name] = spec.origin if spec else "cannot import"
print("GPU_CHECK_ENV " + json.dumps(info))
"""

# Pinned host <-> device copies of 1 GiB, the fastest of 5: what offload's copies cost without overlap.
_BANDWIDTH = r"""
import json, time, torch
n = 2**30
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
def best(copy):
    times = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter(); copy(); torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return n / min(times)
out = {"d2h_bytes_per_s": best(lambda: host.copy_(dev, non_blocking=True)),
       "h2d_bytes_per_s": best(lambda: dev.copy_(host, non_blocking=True))}
print("GPU_CHECK_BANDWIDTH " + json.dumps(out))
"""


def locked_versions(names: tuple[str, ...] = WHEELS, lock: Path = LOCK) -> dict[str, str]:
    """``{name: version}`` of ``names`` as ``requirements/test.lock`` pins them."""
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    missing = [n for n in names if n not in pins]
    if missing:
        raise SystemExit(f"gpu_check: {', '.join(missing)} not pinned in {lock}")
    return {n: pins[n] for n in names}


def fetch_wheels(dest: Path) -> list[Path]:
    """Download the wheels the GPU machines lack, at the lock's versions, for CPython 3.12 on x86-64.

    A distribution published only as an sdist (antlr4-python3-runtime 4.9.3) is built into a wheel here:
    it is pure Python, so the wheel built on this machine installs there.
    """
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in locked_versions().items():
        spec = f"{name}=={version}"
        got = subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                              "--implementation", "cp", *platforms, "-d", str(dest), spec])
        if got.returncode != 0:
            print(f"gpu_check: no wheel of {spec} for Python 3.12: building one from its sdist", file=sys.stderr)
            subprocess.run([*pip, "wheel", "--no-deps", "-w", str(dest), spec], check=True)
    wheels = sorted(dest.glob("*.whl"))
    impure = [w.name for w in wheels if not w.name.endswith("-none-any.whl")]
    if impure:
        raise SystemExit(f"gpu_check: not pure-Python, may not install on the GPU machine: {', '.join(impure)}")
    return wheels


def cuda_tests(tests: Path = ROOT / "tests") -> list[str]:
    """Node ids of the tests that skip without CUDA: a decorator or ``pytestmark`` that names cuda.

    The same rule as ``grep -n cuda`` over the decorators (``@needs_cuda``,
    ``@pytest.mark.skipif(not torch.cuda.is_available(), ...)``), read from the syntax tree.
    """
    ids = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(tests.parent).as_posix()
        whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                    and "cuda" in ast.unparse(n.value).lower() for n in tree.body)

        def visit(body: list[ast.stmt], prefix: str, marked: bool) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                    visit(node.body, f"{prefix}::{node.name}", marked or _names_cuda(node))
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                    if marked or _names_cuda(node):
                        ids.append(f"{prefix}::{node.name}")

        visit(tree.body, rel, whole)
    return ids


def _names_cuda(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    return any("cuda" in ast.unparse(d).lower() for d in node.decorator_list)


def junit(path: Path) -> list[dict[str, Any]]:
    """One row per test of a pytest ``--junitxml`` file: id, outcome, seconds, message."""
    if not path.is_file():
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        # classname is tests.test_x or tests.test_x.TestY: the file is the part that names a test_*.py.
        parts = module.split("/")
        k = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        node = "/".join(parts[: k + 1]) + ".py" + "".join(f"::{p}" for p in parts[k + 1:]) + f"::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").splitlines()[0][:200] if child.get("message") else ""
                break
        rows.append({"id": node, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
    return rows


def _marked(log: Path, marker: str) -> dict[str, Any] | None:
    """The JSON a step printed after ``marker`` (the last one), or None."""
    found = None
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(marker + " "):
                found = json.loads(line[len(marker) + 1:])
    return found


def summary(results: dict[str, Any]) -> str:
    """Every table of the check, as markdown (``gpu_summary.py``)."""
    return gpu_summary.summary(results, TABLE_MODES, (FIT, FIT_GPT), FSDP_FIT, lambda step: Step(**step).status)


def _bench_command(modes: tuple[str, ...], out: Path, dry_run: bool) -> list[str]:
    cmd = [sys.executable, "-m", "ckpt_tools.bench", "--models", "gpt", "--modes", ",".join(modes),
           "--skip", "overhead,compiled", "--keep-going", "--out", str(out)]
    if dry_run:  # a tiny GPT on CPU, one step per mode: seconds
        return [*cmd, "--gpt", DRY_GPT, "--repeats", "1", "--steps", "1", "--min-seconds", "0"]
    return [*cmd, "--device", "cuda", "--precision", "bf16-mixed", "--gpt", GPU_GPT, "--repeats", "3", "--steps", "2",
            "--min-seconds", "0"]


def _pytest(ids: list[str] | tuple[str, ...], xml: Path, workers: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}", *ids]
    return [*cmd, "-n", str(workers)] if workers > 1 else cmd


def _tests(run: Check, name: str, ids: list[str], workers: int) -> list[dict[str, Any]]:
    xml = run.work / f"{name.replace(' ', '_')}.xml"
    # The suite hides the GPUs from itself (tests/conftest.py) but where this is said: the CUDA tests' step.
    run.run(name, _pytest(ids, xml, workers), "tests.log", {"CKPT_TEST_CUDA": "1"} if name == CUDA_TESTS else None)
    return junit(xml)


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The whole pipeline; returns what it wrote into results.json."""
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))  # the bench's own files and pytest's XML: not in out
    path = [str(ROOT)] if args.dry_run else [str(args.site), str(ROOT)]
    sys.path[:0] = [p for p in path if p not in sys.path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONUNBUFFERED="1")
    run = Check(out, work, env, t0 + args.deadline, LIMITS, ROOT)

    if not args.dry_run:
        wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
        if wheels:
            run.run("install", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                "--no-compile", "--target", str(args.site), *map(str, wheels)], "setup.log")
        else:
            run.steps.append(Step("install", [], "setup.log", 0, note=f"no wheels in {args.wheels}: "
                                  "python -m ckpt_tools.gpu_check --fetch-wheels .whl, then carry .whl"))
    run.run("env", [sys.executable, "-c", _ENV], "setup.log")
    envinfo = _marked(out / "setup.log", "GPU_CHECK_ENV")
    bandwidth = None
    if envinfo and envinfo.get("cuda available"):
        run.run("bandwidth", [sys.executable, "-c", _BANDWIDTH], "setup.log")
        bandwidth = _marked(out / "setup.log", "GPU_CHECK_BANDWIDTH")

    # On the GPU each group has a process and a limit of its own; the dry run starts fewer processes (each
    # pays the imports again), so that CI's test of it stays well under a minute.
    cuda_ids = cuda_tests()
    core_files = DRY_TESTS if args.dry_run else CORE_TESTS
    if args.dry_run:
        test_groups = [("tests", [*cuda_ids, *core_files], 1)]
        bench_groups = [("bench", TABLE_MODES)]  # with --offload: one process (the imports cost seconds)
    else:
        test_groups = [(CUDA_TESTS, cuda_ids, 1), ("core tests", list(core_files), args.workers)]
        # What the open issues measure first (offload, the fit steps), the older auto row after them.
        bench_groups = [("bench", BENCH_MODES), ("bench offload", ("none",)), ("bench fit", ("none",))]
        if envinfo and envinfo.get("cuda available"):
            bench_groups.append(("fsdp fit", ()))
        bench_groups.append(("bench auto", AUTO_MODES))
    if args.only:  # a second call on the same machine: the steps that failed, without the others' minutes
        test_groups = [g for g in test_groups if g[0] in args.only]
        bench_groups = [g for g in bench_groups if g[0] in args.only]
    # What only a GPU can show comes first: the CUDA tests, then the bench; the core subset (CPU tests, which
    # the torch-range check also runs on CPU) takes what is left of the deadline.
    ran: list[dict[str, Any]] = []
    rows: dict[str, Any] = {}
    for name, ids, workers in test_groups[:1]:
        ran += _tests(run, name, ids, workers)
    fit = engine = None
    fsdp = fsdp2 = None
    for name, modes in bench_groups:
        if name == "fsdp fit":  # FSDPStrategy, then FSDP2, on the one GPU (tests/fit_fsdp_worker.py --cuda)
            run.run(name, [sys.executable, str(ROOT / "tests" / "fit_fsdp_worker.py"), str(work / "fsdp"),
                           json.dumps([FSDP_FIT, FSDP2_FIT]), "--cuda"], "bench.log")
            fsdp, fsdp2 = (_rank_zero(work / "fsdp" / r["name"]) for r in (FSDP_FIT, FSDP2_FIT))
            continue
        sub = work / name.replace(" ", "_")
        command = _bench_command(modes, sub, args.dry_run)
        if name == "bench fit":  # its own GPT, one none row beside the fit row
            command = [*command[:command.index("--gpt")], "--gpt", FIT_GPT, "--fit", FIT,
                       *command[command.index("--gpt") + 2:]]
        if name == "bench offload" or args.dry_run:
            command = [*command, "--offload", DRY_OFFLOAD_BUDGET if args.dry_run else OFFLOAD_BUDGET]
        run.run(name, command, "bench.log")
        if (sub / "results.json").is_file():
            written = json.loads((sub / "results.json").read_text())
            if name == "bench fit":
                fit = (written.get("fit") or {}).get("gpt")
                continue
            engine = (written.get("offload") or {}).get("gpt") or engine
            if name == "bench offload":
                continue
            rows |= {m: r for m, r in written.get("gpt", {}).items() if m in modes}
    for name, ids, workers in test_groups[1:]:
        ran += _tests(run, name, ids, workers)
    cuda = [r for r in ran if r["id"] in set(cuda_ids)]
    core = [r for r in ran if r["id"] not in set(cuda_ids)]
    counts = {k: sum(r["outcome"] == k for r in core) for k in ("passed", "failed", "error", "skipped")}
    if (work / "bench" / "plot.png").is_file():
        (out / "plot.png").write_bytes((work / "bench" / "plot.png").read_bytes())
    setup_line = ""
    if (work / "bench" / "results.md").is_file():
        setup_line = next((ln for ln in (work / "bench" / "results.md").read_text().splitlines()
                           if ln.startswith("GPT(")), "")
    results = {
        "command": " ".join(["python -m ckpt_tools.gpu_check", *args.argv]),
        "dry_run": args.dry_run, "started": started, "seconds": 0.0, "env": envinfo,
        "steps": [asdict(s) for s in run.steps],
        "tests": {"cuda": cuda,
                  "core": {"files": list(core_files), "passed": counts["passed"], "failed": counts["failed"],
                           "errors": counts["error"], "skipped": counts["skipped"],
                           # what the machine lacks (DeepSpeed, an installed package, ...): each reason, how many
                           "skip_reasons": _skip_reasons(core),
                           "not_passed": [r for r in core if r["outcome"] in ("failed", "error")]}},
        "bench": {"setup": setup_line, "rows": rows},
        "bandwidth": bandwidth,
        "offload": offload_overlap(rows, bandwidth),
        "offload_engine": engine,
        "fit": fit,
        "fsdp_fit": fsdp,
        "fsdp2_fit": fsdp2,
    }
    results["seconds"] = time.monotonic() - t0
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(summary(results))
    return results


def _steps(value: str) -> set[str]:
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = sorted(names - set(LIMITS) - {CUDA_TESTS})
    if unknown:
        raise argparse.ArgumentTypeError(f"no step named {', '.join(map(repr, unknown))}; the steps: "
                                         f"{', '.join(sorted(set(LIMITS) - {'install', 'env', 'bandwidth', 'tests'}))}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_tools.gpu_check", description=__doc__.split("\n\n")[0],
        epilog="Here: python -m ckpt_tools.gpu_check --fetch-wheels .whl. On the GPU machine (repository root, "
        ".whl carried): python3 -m ckpt_tools.gpu_check --wheels .whl --out $OUT. On CPU: --dry-run.",
    )
    parser.add_argument("--fetch-wheels", type=Path, metavar="DIR",
                        help="download (or build) the wheels the GPU machine lacks into DIR, then stop")
    parser.add_argument("--wheels", type=Path, default=Path(".whl"), help="the carried wheels (default: .whl)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"),
                        help="where the wheels are installed, first on every step's path (default: /tmp/site)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check"),
                        help="the folder for summary.md, results.json and the logs (default: $OUT, else gpu_check)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU, the current environment, tiny sizes, a seconds-long test subset")
    parser.add_argument("--deadline", type=float, default=540.0,
                        help="seconds for the whole check; each step also has its own limit, and one cut by it "
                        "may take 20 s more to end (default: 540, so that it ends within 10 minutes, the device tool's per-call limit)")
    parser.add_argument("--only", type=_steps, default=None,
                        help="run only these steps (comma-separated names from the summary's steps table, e.g. "
                        "'cuda tests,fsdp fit'); install, env and bandwidth always run")
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist processes for the core subset")
    return parser


def _rank_zero(folder: Path) -> dict[str, Any] | None:
    """What rank 0 of a fit_fsdp_worker run wrote, or None where it wrote nothing."""
    written = folder / "rank0.json"
    return json.loads(written.read_text()) if written.is_file() else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.fetch_wheels is not None:
        for wheel in fetch_wheels(args.fetch_wheels):
            print(wheel)
        return 0
    args.wheels, args.site = args.wheels.resolve(), args.site.resolve()
    results = check(args)
    print((args.out / "summary.md").read_text())
    failed = [s["name"] for s in results["steps"] if Step(**s).status != "ok"]
    print(f"gpu_check: wrote {args.out}; " + (f"steps not ok: {', '.join(failed)}" if failed else "every step ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

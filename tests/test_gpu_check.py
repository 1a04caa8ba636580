"""``python -m ckpt_tools.gpu_check``: its ``--dry-run`` on CPU writes the tables the GPU run would.

The GPU run itself needs a GPU machine (docs/gpu.md); here the same pipeline runs on CPU with a
tiny GPT: the files, every step's status, one table row per mode and the exact bytes and FLOPs are asserted.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ckpt_tools.gpu_check import (
    CORE_TESTS, DRY_TESTS, LOCK, ROOT, TABLE_MODES, WHEELS, _skip_reasons, cuda_tests, locked_versions,
    offload_overlap, summary,
)

FILES = ("summary.md", "results.json", "setup.log", "tests.log", "bench.log", "plot.png")
BENCH_HEADER = ("| mode | step (ms) | time / none | peak (MiB) | peak / none | kept by the forward (MiB) "
                "| kept / none | FLOP ratio | note |")
# What the GPU machines have of the package's dependencies (DESIGN.md, environment facts).
ON_THE_GPU_MACHINE = {"torch", "lightning", "numpy", "tqdm"}


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """One ``--dry-run`` into a fresh folder: (folder, results.json, summary.md)."""
    out = tmp_path_factory.mktemp("gpu_check")
    cmd = [sys.executable, "-m", "ckpt_tools.gpu_check", "--dry-run", "--out", str(out)]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out, json.loads((out / "results.json").read_text()), (out / "summary.md").read_text()


def test_dry_run_writes_its_files_into_one_folder(dry) -> None:
    out, _, _ = dry
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)  # at most 8, none in a subfolder
    assert (out / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_every_step_ran_and_ended_well(dry) -> None:
    _, results, summary = dry
    assert results["dry_run"] is True
    assert [s["name"] for s in results["steps"]] == ["env", "tests", "bench"]  # bench with --offload
    for step in results["steps"]:
        assert (step["returncode"], step["timed_out"]) == (0, False), step
        assert f"| {step['name']} | ok |" in summary
    assert results["env"]["ckpt_plugin"].startswith(str(ROOT))  # the checkout's package, as on the GPU machine


def test_cuda_tests_are_listed_and_skip_on_cpu(dry) -> None:
    _, results, summary = dry
    rows = results["tests"]["cuda"]
    assert [r["id"] for r in rows] == cuda_tests()
    assert {(r["outcome"], r["message"]) for r in rows} == {("skipped", "needs CUDA")}
    for r in rows:
        assert f"| {r['id']} | skipped |" in summary
    core = results["tests"]["core"]
    assert core["files"] == list(DRY_TESTS)
    assert (core["passed"], core["failed"], core["errors"], core["not_passed"]) == (len(DRY_TESTS), 0, 0, [])


def test_core_skips_are_listed_by_reason(dry) -> None:
    """A skipped core test (what the GPU machine lacks) is named in summary.md with its reason, not only counted."""
    _, results, summary_md = dry
    assert results["tests"]["core"]["skip_reasons"] == {} and "Skipped, by reason" not in summary_md
    rows = [{"id": f"tests/test_x.py::test_{i}", "outcome": outcome, "seconds": 0.0, "message": message}
            for i, (outcome, message) in enumerate([("skipped", "DeepSpeed is not installed"), ("passed", ""),
                                                    ("skipped", "needs CUDA"), ("skipped", "needs CUDA")])]
    reasons = _skip_reasons(rows)
    assert list(reasons.items()) == [("needs CUDA", 2), ("DeepSpeed is not installed", 1)]
    results = copy.deepcopy(results)  # the module's one dry run: the other tests read it as written
    results["tests"]["core"] |= {"skipped": 3, "skip_reasons": reasons}
    lines = summary(results).splitlines()
    at = lines.index("Skipped, by reason:")
    assert lines[at + 2:at + 4] == ["- 2 skipped: needs CUDA", "- 1 skipped: DeepSpeed is not installed"]


def test_bench_table_has_one_row_per_mode(dry) -> None:
    _, _, summary = dry
    lines = summary.splitlines()
    start = lines.index(BENCH_HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == list(TABLE_MODES)
    assert all(r.count(" | ") == BENCH_HEADER.count(" | ") for r in rows)
    assert "| – |" not in "\n".join(rows)  # every mode measured


def test_bench_rows_are_exact_where_they_can_be(dry) -> None:
    rows = dry[1]["bench"]["rows"]
    assert list(rows) == list(TABLE_MODES)
    none, full, selective, offload, auto = (rows[m] for m in TABLE_MODES)
    assert none["flops_ratio"] == 1.0 and none["act_fraction"] == 1.0
    assert full["act_peak_bytes"] < none["act_peak_bytes"] and full["flops_ratio"] > 1.0
    assert selective["flops_ratio"] == 1.0  # it saves the matmuls, the only ops FlopCounterMode counts
    # On CPU offload moves nothing: the same bytes and FLOPs as none, and the row says why.
    assert (offload["act_peak_bytes"], offload["peak_bytes"], offload["flops"]) == (
        none["act_peak_bytes"], none["peak_bytes"], none["flops"])
    assert any("moves nothing" in n for n in offload["notes"])
    assert auto["act_peak_bytes"] <= 0.5 * none["act_peak_bytes"]


def test_offload_overlap_on_cpu_has_times_but_no_bytes_moved(dry) -> None:
    _, results, summary = dry
    assert results["bandwidth"] is None  # no CUDA: no copy to time
    ov = results["offload"]
    assert ov["moved_bytes"] is None and ov["hidden"] is None
    assert ov["none_step_s"] > 0 and ov["offload_step_s"] > 0
    assert "## Offload's overlap" in summary


def test_offload_overlap_arithmetic() -> None:
    rows = {"none": {"step_seconds": 0.5, "forward_kept_bytes": 10 * 2**30, "peak_bytes": 20 * 2**30},
            "offload": {"step_seconds": 0.7, "forward_kept_bytes": 2**30, "peak_bytes": 12 * 2**30}}
    ov = offload_overlap(rows, {"d2h_bytes_per_s": 9 * 2**30 / 0.3, "h2d_bytes_per_s": 9 * 2**30 / 0.1})
    assert ov["moved_bytes"] == 9 * 2**30
    assert ov["copy_s"] == pytest.approx(0.4)
    assert ov["added_s"] == pytest.approx(0.2)
    assert ov["hidden"] == pytest.approx(0.5)  # half of the copies' serial time hidden behind compute


def test_cuda_tests_are_found_by_their_decorators(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import pytest, torch\n"
        "from helpers import needs_cuda\n"
        "@needs_cuda\ndef test_one(): pass\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='GPU')\ndef test_two(): pass\n"
        "def test_cpu(): pass\n"
        "@pytest.mark.slow\ndef test_slow(): pass\n"
        "class TestGroup:\n    @needs_cuda\n    def test_three(self): pass\n    def test_four(self): pass\n"
    )
    (tmp_path / "tests" / "test_b.py").write_text(
        "import pytest, torch\npytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
        "def test_five(): pass\n"
    )
    (tmp_path / "tests" / "helpers.py").write_text("@needs_cuda\ndef test_not_a_test_file(): pass\n")
    assert cuda_tests(tmp_path / "tests") == [
        "tests/test_a.py::test_one", "tests/test_a.py::test_two", "tests/test_a.py::TestGroup::test_three",
        "tests/test_b.py::test_five",
    ]


def test_the_suite_s_cuda_tests_are_offload_s_and_ckpt_memory_s() -> None:
    ids = cuda_tests()
    offload = [i for i in ids if i.startswith(("tests/test_offload.py::test_cuda_",
                                               "tests/test_offload_pool.py::test_cuda_"))]
    assert offload and set(ids) - set(offload) == {
        "tests/test_memory_config.py::test_a_share_of_a_cuda_device_is_of_its_total_memory",
        "tests/test_auto_sharded.py::test_zero_3_offload_on_a_gpu_leaves_the_host_s_bytes_out_of_the_device_s_step"}, ids
    assert set(CORE_TESTS) >= {"tests/test_offload.py", "tests/test_offload_pool.py", "tests/test_offload_plan.py",
                               *(i.split("::")[0] for i in DRY_TESTS)}


def test_the_offload_step_reports_the_engine_and_the_plans(dry) -> None:
    """``ckpt-bench --offload``: on CPU no link, nothing moved, no host allocation, auto with and without offload
    planned at the same budget; its tables in the summary."""
    _, results, summary = dry
    engine = results["offload_engine"]
    assert engine["link"] is None and engine["moved_bytes_per_step"] == 0 and engine["hidden"] is None
    assert engine["host_allocations_after_step"] == [0, 0, 0, 0] and engine["hideable_layers"] == []
    for label in ("auto", "auto no offload"):
        assert engine[label]["offload_bytes"] == 0
        assert not any(o in ("offload", "full+offload") for o in engine[label]["choices"].values())
    assert "## Offload that hides (`ckpt-bench --offload`)" in summary
    assert "| gpt | none (CPU: nothing moves) | 0.0 MiB |" in summary


def test_carried_wheels_cover_what_the_gpu_machine_lacks() -> None:
    """Every dependency of the package that the GPU machine lacks is carried, at the lock's version."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lacking = {Requirement(d).name.lower() for d in deps} - ON_THE_GPU_MACHINE
    assert lacking <= set(WHEELS), lacking - set(WHEELS)
    pins = {line.split("==")[0].lower(): line.split("==")[1] for line in LOCK.read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert locked_versions() == {name: pins[name] for name in WHEELS}


def test_device_command_fits_in_one_call() -> None:
    """docs/gpu.md's command for the GPU machine: under the 2,000 characters a device call takes."""
    from test_docs import blocks, commands

    shown = [line for b in blocks() if b.page == "docs/gpu.md" and b.mark.startswith("not run: needs a GPU")
             for line in commands(b.body)]
    command = "python3 -m ckpt_tools.gpu_check --wheels .whl --out $OUT"
    assert shown == [command] and command in sys.modules["ckpt_tools.gpu_check"].__doc__
    assert len(command) < 2000


def test_the_fsdp_fit_table_reads_the_worker_s_record(dry) -> None:
    """The GPU run's FSDP step (tests/fit_fsdp_worker.py --cuda) writes a rank's record; the summary's row is it."""
    from ckpt_tools.gpu_check import summary

    _, results, said = dry
    assert results["fsdp_fit"] is None
    assert "## Under FSDP (Lightning's FSDPStrategy, one GPU)\n\nNot run in a dry run." in said
    record = {"wrapped": ["blocks.0._fsdp_wrapped_module"], "predicted": 3 * 2**20, "measured": 3 * 2**20 + 8,
              "limit": 4 * 2**20, "cuda_peak": 5 * 2**20}
    table = summary({**results, "dry_run": False, "fsdp_fit": record})
    assert "| 4.0 | 1 | 3.0 | 3.0 | 5.0 | NO |" in table  # MiB; the allocator's peak over the limit: NO
    table = summary({**results, "dry_run": False, "fsdp_fit": {**record, "cuda_peak": 4 * 2**20}})
    assert "| 4.0 | 1 | 3.0 | 3.0 | 4.0 | yes |" in table


def test_the_fsdp2_fit_has_a_table_of_its_own(dry) -> None:
    """ckpt.memory=device under FSDP2 on the one GPU (issue #43): its rank's record in a section of its own."""
    from ckpt_tools.gpu_check import FSDP2_FIT, summary

    _, results, said = dry
    assert results["fsdp2_fit"] is None and FSDP2_FIT["strategy"] == "fsdp2" and FSDP2_FIT["memory"] == "device"
    assert "## Under FSDP2 (ModelParallelStrategy, a world of one)\n\nNot run in a dry run." in said
    record = {"wrapped": [], "predicted": 3 * 2**20, "measured": 3 * 2**20, "limit": 8 * 2**20, "cuda_peak": 4 * 2**20}
    table = summary({**results, "dry_run": False, "fsdp2_fit": record})
    section = table.split("## Under FSDP2")[1]
    assert "ckpt.memory=device" in section and "| 8.0 | 0 | 3.0 | 3.0 | 4.0 | yes |" in section


def test_only_the_cuda_tests_step_shows_the_gpus_to_the_suite(tmp_path) -> None:
    """tests/conftest.py hides the GPUs from the whole process unless CKPT_TEST_CUDA=1; the check sets it for the
    CUDA tests' step and for no other (the first H200 run: hidden and shown per test, the CUDA tests all failed
    with "No CUDA GPUs are available")."""
    import time

    from ckpt_tools.gpu_check import CUDA_TESTS, LIMITS, _tests
    from ckpt_tools.gpu_steps import Check

    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\n\ndef test_shown():\n    assert os.environ.get('CKPT_TEST_CUDA') == '1'\n")
    run = Check(tmp_path, tmp_path, dict(os.environ), time.monotonic() + 120, LIMITS, tmp_path)
    outcomes = {name: [r["outcome"] for r in _tests(run, name, [str(probe)], 1)] for name in (CUDA_TESTS, "core tests")}
    assert outcomes == {CUDA_TESTS: ["passed"], "core tests": ["failed"]}

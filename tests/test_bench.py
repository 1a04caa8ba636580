"""ckpt-bench end to end: a ``--quick`` run, as a user types it, writes its three files.

Bytes and FLOPs are exact and asserted; timings never are (DESIGN.md, how we measure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python

from ckpt_tools.bench import MODELS, MODES, QUICK_MODES, build, main, pareto_front

ROOT = Path(__file__).resolve().parents[1]

AUTO = {"segments_optimal": 0.5}  # planned for a budget (met on the GPT, refused on the ResNet)
KEYS = ("peak_bytes", "act_peak_bytes", "flops_ratio", "time_ratio")
PNG = b"\x89PNG\r\n\x1a\n"


def run_bench(cwd: Path, modes: list[str]) -> tuple[list[str], Path]:
    """``python -m ckpt_tools.bench --quick --out tmp --modes ...`` in ``cwd``; returns its argv and out dir."""
    # The compiled comparison compiles twice (minutes): tests/test_compiled_budget.py covers it; the overhead
    # entry (4 s) tests/test_overhead.py. One timing round: the suite asserts bytes, FLOPs and the files, never a timing.
    args = ["--quick", "--repeats", "1", "--steps", "1", "--min-seconds", "0", "--out", "tmp", "--modes", ",".join(modes),
            "--skip", "compiled,overhead"]
    cmd = ["-m", "ckpt_tools.bench", *args]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = warm_python.run(cmd, env=env, cwd=cwd, timeout=300)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
    return args, cwd / "tmp"


# Every mode but auto's fractions, planned as auto_min is (the suite's time: each auto row plans on both
# models, a refused one the layers' parts too). auto_min is a ckpt=auto row (inside the GPT's blocks);
# segments_optimal a planned row met (the GPT) and refused (the ResNet); tests/test_auto.py, test_inside.py
# and test_rotor.py plan for fractions.
RUN = [mode for mode in MODES if not mode.startswith("auto_") or mode == "auto_min"]


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, dict]:
    """One quick run of the modes in RUN, shared by the checks below."""
    args, out = run_bench(tmp_path_factory.mktemp("bench"), RUN)
    return args, out, json.loads((out / "results.json").read_text())


def test_writes_results_json_table_and_plot(fixed) -> None:
    _, out, _ = fixed
    for name in ("results.json", "results.md", "plot.png"):
        assert (out / name).is_file(), name
    assert (out / "plot.png").read_bytes().startswith(PNG)


def test_every_model_and_mode_has_the_four_numbers(fixed) -> None:
    _, _, results = fixed
    assert list(results) == list(MODELS)  # --skip compiled,overhead: neither entry is written
    for model, rows in _models(results).items():
        assert list(rows) == RUN, model
        for mode, row in rows.items():
            if row.get("error"):
                assert mode in AUTO, (model, mode, row["error"])  # only a budget may be refused
                continue
            for key in KEYS:
                assert isinstance(row[key], int | float), (model, mode, key, row.get(key))


def test_none_is_the_reference(fixed) -> None:
    for rows in _models(fixed[2]).values():
        assert rows["none"]["flops_ratio"] == 1.0
        assert rows["none"]["act_peak_bytes"] / rows["none"]["act_peak_bytes"] == rows["none"]["act_fraction"] == 1.0


def test_full_keeps_fewer_activations_and_recomputes(fixed) -> None:
    for model, rows in _models(fixed[2]).items():
        assert rows["full"]["act_peak_bytes"] < rows["none"]["act_peak_bytes"], model
        assert rows["full"]["peak_bytes"] < rows["none"]["peak_bytes"], model
        assert rows["full"]["flops_ratio"] > 1.0, model


def test_selective_matmuls_recomputes_no_counted_flops(fixed) -> None:
    # FlopCounterMode counts matmuls and convolutions only, and those are exactly what the policy saves.
    for model, rows in _models(fixed[2]).items():
        assert rows["selective"]["flops_ratio"] == 1.0, model


def test_full_costs_what_hand_written_checkpointing_costs(fixed) -> None:
    results = fixed[2]
    for model, rows in _models(results).items():
        assert rows["full"]["flops"] == rows["hand"]["flops"], model
        assert rows["full"]["flops_ratio"] == rows["hand"]["flops_ratio"], model
    # Peaks (exact): the same bytes. The one addition is the BatchNorm fix (pytorch#96136),
    # which holds a copy of the running statistics of the block being recomputed.
    assert results["gpt"]["full"]["peak_bytes"] == results["gpt"]["hand"]["peak_bytes"]
    assert results["gpt"]["full"]["act_peak_bytes"] == results["gpt"]["hand"]["act_peak_bytes"]
    resnet = build(MODELS["resnet"], "none", quick=True).model
    stats = sum(b.untyped_storage().nbytes() for b in resnet.buffers())
    extra = results["resnet"]["full"]["peak_bytes"] - results["resnet"]["hand"]["peak_bytes"]
    assert 0 <= extra <= stats


def test_table_starts_with_the_command_line(fixed) -> None:
    args, out, _ = fixed
    text = (out / "results.md").read_text()
    command = "python -m ckpt_tools.bench " + " ".join(args)
    assert command in text.split("## ")[0]
    for model in MODELS:
        assert f"## {model}" in text
    for mode in RUN:
        assert f"| {mode} |" in text


def test_auto_budgets_are_met_or_refused(fixed) -> None:
    for model, rows in _models(fixed[2]).items():
        none, full = rows["none"], rows["full"]
        for mode, budget in AUTO.items():
            row = rows[mode]
            if row.get("error"):
                # Refused only when even checkpointing every layer does not fit.
                assert full["act_peak_bytes"] > budget * none["act_peak_bytes"], (model, mode, row["error"])
                continue
            assert row["act_peak_bytes"] <= budget * none["act_peak_bytes"], (model, mode)
            # Where full fits, no plan recomputes more; below it, parts recompute inside recomputed layers.
            fits = full["act_peak_bytes"] <= budget * none["act_peak_bytes"]
            assert 1.0 <= row["flops_ratio"] <= (full["flops_ratio"] if fits else 2.0), (model, mode)
            # The planner's peak is an upper bound within 5 % of what the step then measures.
            assert 0.99 <= row["predicted_over_measured_peak"] <= 1.05, (model, mode, row)
            assert row["predicted_peak_bytes"] <= budget * none["act_peak_bytes"], (model, mode)
            # None: the step without checkpointing, predicted from timings (full step minus what each layer's
            # recompute adds), came out <= 0 on a loaded machine; timings are never asserted, only their sign.
            ratio = row["predicted_time_ratio"]
            assert ratio is None or ratio >= 1.0 or set(row["choices"].values()) == {"keep"}, (model, mode)
            # Planning ran on fake tensors: its real memory is a fraction of the step it avoids.
            if row["profile_peak_bytes"] is not None:
                assert row["profile_peak_bytes"] < none["act_peak_bytes"], (model, mode, row["profile_peak_bytes"])


def test_auto_min_keeps_no_more_than_full_and_is_predicted(fixed) -> None:
    for model, rows in _models(fixed[2]).items():
        least, full, none = rows["auto_min"], rows["full"], rows["none"]
        # Checkpointing every candidate is one of its plans (the ResNet's candidates include its stem).
        assert least["act_peak_bytes"] <= full["act_peak_bytes"], (model, least, full)
        assert 0.99 <= least["predicted_over_measured_peak"] <= 1.05, (model, least)
        assert least["flops_ratio"] >= 1.0, model
        ratio = least["predicted_time_ratio"]  # timings are never asserted, only their sign (see above)
        assert ratio is None or ratio >= 1.0, (model, ratio)
        if least["profile_peak_bytes"] is not None:  # planning ran on fake tensors
            assert least["profile_peak_bytes"] < none["act_peak_bytes"], (model, least["profile_peak_bytes"])


def test_skipped_extras_are_left_out_of_the_table(fixed) -> None:
    text = (fixed[1] / "results.md").read_text()
    assert "## overhead" not in text and "## torch.compile" not in text


def _models(results: dict) -> dict:
    return {model: rows for model, rows in results.items() if model in MODELS}


def test_pareto_front_keeps_the_points_nothing_beats() -> None:
    points = {"a": (1.0, 1.0), "b": (2.0, 0.5), "c": (2.0, 0.8), "d": (3.0, 0.6), "e": (0.5, 2.0)}
    assert pareto_front(points) == ["e", "a", "b"]


def test_unknown_mode_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--modes", "none,ful", "--out", "unused"])
    assert err.value.code == 2
    assert "--modes: 'ful' is not one of them; valid, closest first: full" in capsys.readouterr().err


def test_without_matplotlib_the_tables_are_written_and_the_plot_skipped(tmp_path: Path) -> None:
    """A user's environment without matplotlib (an optional dependency), in a new interpreter.

    The stand-in for that environment is a ``sitecustomize`` first on PYTHONPATH that makes matplotlib
    absent as an uninstalled package is: ``import`` and ``find_spec`` raise ModuleNotFoundError and its
    distribution's metadata is not found. A ``matplotlib/__init__.py`` that raises would not do:
    torchmetrics (under Lightning) sees matplotlib's metadata, imports it and fails, which no user
    without matplotlib sees.
    """
    site = tmp_path / "no_matplotlib"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.metadata as md, sys\n"
        "class NoMatplotlib:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'matplotlib':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoMatplotlib)\n"
        "_from_name = md.Distribution.from_name.__func__\n"
        "def from_name(cls, name):\n"
        "    if name.lower() == 'matplotlib':\n"
        "        raise md.PackageNotFoundError(name)\n"
        "    return _from_name(cls, name)\n"
        "md.Distribution.from_name = classmethod(from_name)\n"
    )
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [sys.executable, "-m", "ckpt_tools.bench", "--models", "gpt", "--modes", "none,full", "--repeats", "1",
           "--steps", "1", "--min-seconds", "0", "--skip", "overhead,compiled", "--out", "out",
           "--gpt", "n_layer=2,n_embd=32,n_head=2,block_size=16,batch_size=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.json", "results.md"]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["gpt"]) == ["none", "full"]
    assert results["gpt"]["full"]["act_peak_bytes"] < results["gpt"]["none"]["act_peak_bytes"]
    said = [line for line in proc.stderr.splitlines() if "plot.png" in line]
    assert said == ["ckpt-bench: plot.png skipped: matplotlib cannot be imported (No module named 'matplotlib'); "
                    "pip install 'ckpt-plugin[bench]'"]
    assert "wrote out/results.json, out/results.md\n" in proc.stdout


def test_size_keywords_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--gpt", "n_layers=2", "--out", "unused"])
    assert err.value.code == 2
    assert "--gpt: 'n_layers' is not a keyword of GPT; valid, closest first: n_layer" in capsys.readouterr().err


def test_cuda_device_without_cuda_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--device", "cuda", "--out", "unused"])
    assert err.value.code == 2
    assert f"--device=cuda: torch {torch.__version__} sees no CUDA device" in capsys.readouterr().err


def test_quick_modes_are_bench_modes() -> None:
    assert set(QUICK_MODES) <= set(MODES) and QUICK_MODES[0] == "none"


def test_fit_row_chooses_a_batch_and_plan_within_the_limit(tmp_path: Path) -> None:
    """``--fit 0.5`` on a tiny GPT (the --quick one takes minutes to plan on 2 cores): ckpt.batch=max's batch and
    the plan for it, whose real whole step is within the limit, beside no checkpointing at that batch and at the
    largest batch that fits without it. Bytes are asserted, samples per second only for being there."""
    cmd = ["-m", "ckpt_tools.bench", "--models", "gpt", "--modes", "none", "--repeats", "1", "--steps", "1",
           "--min-seconds", "0", "--skip", "compiled,overhead", "--fit", "0.5", "--out", "out",
           "--gpt", "n_layer=2,n_embd=32,n_head=2,block_size=16,batch_size=2"]
    proc = warm_python.run(cmd, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""}, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    row = json.loads((tmp_path / "out" / "results.json").read_text())["fit"]["gpt"]
    assert row["limit"] == row["wmin"] + round(0.5 * (row["w0"] - row["wmin"])), row
    assert row["measured"] <= row["limit"], row
    assert abs(row["predicted"] / row["measured"] - 1) <= 0.02, row
    # The limit holds the least plan's step at the sample's batch and not none's: a batch at least the sample's,
    # which none cannot hold, and a largest batch without checkpointing below the sample's.
    assert row["batch"] >= row["sample_batch"] and not row["none_fits"], row
    assert row["none_at_batch"] > row["limit"], row
    assert row["none_batch"] < row["sample_batch"], row
    for key in ("samples_per_s", "none_samples_per_s"):
        assert row[key] > 0, (key, row)
    assert (row["none_largest_samples_per_s"] is None) == (row["none_batch"] == 0), row
    table = (tmp_path / "out" / "results.md").read_text()
    assert "## fit" in table and f"| gpt | 0.5: {row['limit'] / 2**20:.2f} MiB | {row['batch']} |" in table


def test_fit_limit_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--fit", "half", "--out", "unused"])
    assert err.value.code == 2
    assert ("--fit='half' is neither a fraction in [0, 1] of the way from the least whole step to the one without "
            "checkpointing (0.5) nor a size (3MiB)") in capsys.readouterr().err

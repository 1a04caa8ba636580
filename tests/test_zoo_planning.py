"""``ckpt=auto`` plans the zoo's models called as their users call them (issue #20, point 2).

One model per family: a decoder LM with its default KV cache and a padded
mask, an encoder, an encoder-decoder, a mixture of experts (its experts run
through ``torch._grouped_mm``), a state-space model, a vision model with
stages, an audio encoder-decoder, a DenseNet's BatchNorm and list arguments.
Each is planned (profile on fake tensors, per-layer timing, the plan) on its
own training call, then trains one step: loss and every gradient and buffer
bitwise those without checkpointing.
"""

from __future__ import annotations

import re

import pytest

from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import install
from ckpt_tools.zoo import all_models
from ckpt_tools.zoo.measure import _cache_off, _differences, _train

pytest.importorskip("transformers")

ZOO = {entry.name: entry for entry in all_models()}
FAMILIES = ["hf.qwen2", "hf.bert", "hf.bart", "hf.mixtral", "hf.mamba", "hf.swin", "hf.whisper", "shape.densenet"]


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_plans_and_trains_exactly(name: str) -> None:
    entry = ZOO[name]
    model = entry.build()
    wrapped = apply_config(model, make_config(layers="auto", mode="auto", budget=0.75),
                           forward=lambda: entry.loss(model(**entry.batch())))
    assert wrapped  # 0.75 of the peak without checkpointing needs at least one layer wrapped
    plain, planned = _train(entry, entry.build()), _train(entry, model)
    assert _differences(plain, planned) == []  # planning left no trace (buffers, RNG), the step is exact
    assert planned.act_peak <= 0.75 * plain.act_peak


@pytest.mark.parametrize("name", ["hf.convbert", "hf.funnel", "hf.swinv2"])
def test_layers_that_write_a_saved_output_in_place_run_selective_exactly(name: str) -> None:
    """These layers write in place an output that ``selective`` saves (ConvBERT's convolution, Funnel's attention
    scores, Swin V2's attention projection): the policy keeps its value from before the write, so ``ckpt=selective``
    trains bitwise and holds less than none."""
    entry = ZOO[name]
    plain = _train(entry, _cache_off(entry.build()))
    model = entry.build()
    apply_config(model, make_config(layers="auto", mode="selective"))
    selective = _train(entry, model)
    assert _differences(plain, selective) == [] and selective.act_peak < plain.act_peak


def test_auto_plans_min_inside_layers_that_write_a_saved_output_in_place() -> None:
    """ConvBERT planned down to ``min`` (its layers' and their parts' selective options measured, the writes copied),
    bitwise (Funnel: the zoo command's test below; all three: ``python -m ckpt_tools.zoo --min``)."""
    entry = ZOO["hf.convbert"]
    model = entry.build()
    assert apply_config(model, make_config(layers="auto", mode="auto", budget="min"),
                        forward=lambda: entry.loss(model(**entry.batch())))
    assert _differences(_train(entry, _cache_off(entry.build())), _train(entry, model)) == []


def test_a_forward_that_reads_values_is_planned_and_trains_exactly() -> None:
    """Wav2Vec2's SpecAugment reads lengths as Python numbers and writes a boolean mask into its features
    (``x[mask] = v``, whose backward reads the mask again): planned by replaying what one forward without
    autograd read (``measure/values.py``), then one step bitwise the plain one."""
    entry = ZOO["hf.wav2vec2"]
    model = entry.build()
    assert apply_config(model, make_config(layers="auto", mode="auto", budget=0.9),
                        forward=lambda: entry.loss(model(**entry.batch())))
    assert _differences(_train(entry, entry.build()), _train(entry, model)) == []


def test_the_module_min_names_outside_ckpt_layers_takes_it_lower_when_selected() -> None:
    """Hugging Face's ResNet: ``layers=auto`` chooses its bottleneck layers, and the embedder (a convolution,
    BatchNorm and ReLU at full resolution) keeps much of the rest; ``ckpt.budget=min`` names it, and selecting it
    by that name reaches a lower peak, gradients and buffers still bitwise those without checkpointing."""
    entry = ZOO["hf.resnet"]
    peaks = {}
    named = None
    for layers in ("auto", None):
        model = entry.build()
        forward = lambda model=model: entry.loss(model(**entry.batch()))  # noqa: E731
        plan = plan_for(model, make_config(layers=layers or ["ResNetBottleNeckLayer", named], mode="auto",
                                           budget="min"), forward)
        if layers == "auto":
            named = re.search(r"outside ckpt\.layers, (\S+) keeps", plan.summary)[1]
            assert named == "resnet.embedder"
        install(model, plan)
        plain, planned = _train(entry, entry.build()), _train(entry, model)
        assert _differences(plain, planned) == []
        peaks[layers] = planned.act_peak
    assert peaks[None] < peaks["auto"], peaks


def test_one_more_candidate_does_not_make_min_hold_more() -> None:
    """Hugging Face's BERT with its prediction head (``cls``) a candidate too: the plan of the least predicted peak
    goes inside the head and measures more than predicted; ``ckpt.budget=min`` looks past it (``Profile.least``)
    and holds no more than without the head, bitwise."""
    entry = ZOO["hf.bert"]
    peaks = {}
    for layers in (("BertLayer",), ("BertLayer", "cls")):
        model = entry.build()
        apply_config(model, make_config(layers=list(layers), mode="auto", budget="min"),
                     forward=lambda model=model: entry.loss(model(**entry.batch())))
        plain, planned = _train(entry, _cache_off(entry.build())), _train(entry, model)
        assert _differences(plain, planned) == []
        peaks[layers] = planned.act_peak
    assert peaks[("BertLayer", "cls")] <= peaks[("BertLayer",)], peaks


def test_the_zoo_command_prints_the_least_plan_measured(capsys: pytest.CaptureFixture) -> None:
    """``python -m ckpt_tools.zoo --min``: beside the peaks, the step's peak with ``ckpt=auto``'s least plan (Funnel:
    below full on its layers, above the forward's floor), bitwise; a budget 10 % above it met; the summary line."""
    from ckpt_tools.zoo.__main__ import main

    assert main(["--min", "hf.funnel"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("hf.funnel"))
    sizes = [float(n) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[u] for n, u in re.findall(r"([\d.]+) (B|KiB|MiB)", row)]
    none, ours, floor, least = sizes  # Funnel has no checkpointing of its own: no "own" column
    assert floor <= least < ours < none
    assert abs(float(row.split()[-2]) - least / none) < 0.002 and "NOT BITWISE" not in row  # sizes printed rounded
    assert row.split()[-1] == "met"  # 1.1x min's peak: a budget the planner reaches, met
    assert "ckpt=auto ckpt.budget=min planned 1 of them (the others cannot run on fake tensors): bitwise on 1" in out
    assert "a budget of 1.1x min's peak met, bitwise, on 1" in out

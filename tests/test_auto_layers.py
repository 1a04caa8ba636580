"""``ckpt.layers=auto``: the model's repeated block, chosen without configuration, and said.

Hugging Face models are built from configs (nothing downloaded); the rule for
every other model is the longest run of one class in an ``nn.ModuleList`` or
``nn.Sequential``. Each choice is checked by name and by the exact note the
plan and the report carry; one case trains and compares gradients bit for bit
with no checkpointing; every mode accepts ``auto``.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ckpt_plugin import ConfigError, apply_checkpointing, make_config, wrapped_modules
from ckpt_plugin.config.plan import plan_for
from ckpt_plugin.engine.selection import resolve_layers, select_layers
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.measure.report import wrap_report
from conftest import small_gpt

transformers = pytest.importorskip("transformers")

BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
GPT_NOTE = "ckpt.layers=auto chose TransformerBlock (the longest run of one class, in 'blocks'): 4 modules"


def tiny_gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Residual(nn.Module):
    width = 8

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(self.width, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Block(_Residual):
    pass


class Other(_Residual):
    """As big as a Block, by another name."""


class Wide(_Residual):
    width = 16


# ---------------------------------------------------------------------- what auto chooses

def test_hf_gpt2_chooses_its_no_split_module() -> None:
    model = tiny_gpt2()
    assert resolve_layers(model, "auto") == (
        ("GPT2Block",), "ckpt.layers=auto chose GPT2Block (HF _no_split_modules): 3 modules")
    assert apply_checkpointing(model, layers="auto") == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_hf_llama_chooses_its_decoder_layer() -> None:
    model = tiny_llama()
    assert resolve_layers(model, "auto") == (
        ("LlamaDecoderLayer",), "ckpt.layers=auto chose LlamaDecoderLayer (HF _no_split_modules): 2 modules")
    assert select_layers(model, "auto") == ["model.layers.0", "model.layers.1"]


def test_the_example_gpt_chooses_its_transformer_block() -> None:
    model = small_gpt()
    assert resolve_layers(model, "auto") == (("TransformerBlock",), GPT_NOTE)
    assert apply_checkpointing(model, layers="auto") == BLOCKS


def test_a_sequential_of_identical_blocks() -> None:
    # ResNet-like: the model itself is the stack; a Sequential inside a block holds no run.
    model = nn.Sequential(nn.Conv2d(3, 8, 3), *(Block() for _ in range(5)), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert resolve_layers(model, "auto") == (
        ("Block",), "ckpt.layers=auto chose Block (the longest run of one class, in the model itself): 5 modules")
    assert apply_checkpointing(model, layers="auto") == ["1", "2", "3", "4", "5"]


class TwoStacks(nn.Module):
    def __init__(self, first: list[nn.Module], second: list[nn.Module]) -> None:
        super().__init__()
        self.first, self.second = nn.ModuleList(first), nn.Sequential(*second)


def test_the_longest_run_wins_then_the_most_parameters_then_the_first() -> None:
    longer = TwoStacks([Wide(), Wide()], [Block(), Block(), Block()])
    assert resolve_layers(longer, "auto") == (
        ("Block",), "ckpt.layers=auto chose Block (the longest run of one class, in 'second'): 3 modules")
    bigger = TwoStacks([Block(), Block()], [Wide(), Wide()])  # as long: Wide holds more parameters
    assert resolve_layers(bigger, "auto") == (
        ("Wide",), "ckpt.layers=auto chose Wide (the longest run of one class, in 'second'): 2 modules")
    tied = TwoStacks([Other(), Other()], [Block(), Block()])  # as long, as big: the first
    assert resolve_layers(tied, "auto") == (
        ("Other",), "ckpt.layers=auto chose Other (the longest run of one class, in 'first'): 2 modules")


def test_a_run_counts_consecutive_children_only() -> None:
    # Three Blocks in `first`, never two in a row; two Wides in a row in `second`.
    model = TwoStacks([Block(), Wide(), Block(), Wide(), Block()], [Wide(), Wide()])
    assert resolve_layers(model, "auto")[0] == ("Wide",)


def test_declared_no_split_modules_without_importing_transformers() -> None:
    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(10, 8)

    class Layer(_Residual):
        pass

    class Model(nn.Module):  # a PreTrainedModel as far as auto can tell: it declares the attribute
        _no_split_modules = ["Embed", "Layer", "NotInThisModel"]

        def __init__(self) -> None:
            super().__init__()
            self.embed = Embed()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.longer = nn.ModuleList([Block() for _ in range(4)])  # longer, but the declaration wins

    class Wrapper(nn.Module):  # declared on a submodule: found all the same
        def __init__(self) -> None:
            super().__init__()
            self.inner = Model()

    # Embed occurs once beside two Layers: not a stack, left out.
    note = "ckpt.layers=auto chose Layer (HF _no_split_modules): 2 modules"
    assert resolve_layers(Model(), "auto") == (("Layer",), note)
    assert resolve_layers(Wrapper(), "auto") == (("Layer",), note)
    assert select_layers(Wrapper(), "auto") == ["inner.layers.0", "inner.layers.1"]


def test_declared_classes_absent_fall_back_to_the_longest_run() -> None:
    model = nn.Sequential(Block(), Block())
    model._no_split_modules = ["GPT2Block"]
    assert resolve_layers(model, "auto") == (
        ("Block",), "ckpt.layers=auto chose Block (the longest run of one class, in the model itself): 2 modules")


def test_no_repeated_block_is_an_error_naming_what_was_looked_for() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)  # repeated, but in no ModuleList or Sequential
            self.mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))  # no two in a row

    message = (
        "ckpt.layers=auto found no repeated block in Net: no submodule declares Hugging Face's _no_split_modules, "
        "and no nn.ModuleList or nn.Sequential holds two or more consecutive children of one class; name the "
        "layers instead (a class name, a module name or a glob such as 'blocks.*'); class names in this model, "
        "most instances first: Linear, Net, ReLU, Sequential"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        apply_checkpointing(Net(), layers="auto")
    model = Net()
    model._no_split_modules = ["Block"]
    declared = "found no repeated block in Net: the classes its _no_split_modules declares (Block) are not in it, and"
    with pytest.raises(ConfigError, match=re.escape(declared)):
        select_layers(model, "auto")


def test_auto_is_given_alone() -> None:
    message = re.escape("ckpt.layers: 'auto' chooses every layer itself and cannot be combined with other entries "
                        "('head'); give ckpt.layers=auto alone, or name every layer")
    with pytest.raises(ConfigError, match=message):
        make_config(layers=["auto", "head"])
    with pytest.raises(ConfigError, match=message):
        select_layers(small_gpt(), ["auto", "head"])
    assert make_config(layers=["auto"]).layers == ("auto",)


# ---------------------------------------------------------------------- the choice is said

def test_the_plan_and_the_report_carry_the_note() -> None:
    model = small_gpt()
    plan = plan_for(model, make_config(layers="auto"))
    assert plan.note == plan.summary == GPT_NOTE
    assert plan_for(model, make_config(layers="TransformerBlock")).summary == ""  # named layers: nothing to say
    names = apply_checkpointing(model, layers="auto")
    x = model.example_input_array
    report = wrap_report(model, names, lambda: model(x), note=plan.note)
    lines = str(report).splitlines()
    assert lines[0] == GPT_NOTE
    assert lines[1] == "Activation checkpointing wrapped 4 module(s) of GPT; saved activations of one forward:"
    assert str(wrap_report(model, names, lambda: model(x))).splitlines()[0] == lines[1]  # no note: as before


def test_apply_logs_the_note(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="ckpt_plugin"):
        apply_checkpointing(small_gpt(), layers="auto", every_n=2)
    assert [r.getMessage() for r in caplog.records] == [GPT_NOTE]


# ---------------------------------------------------------------------- every mode, exact gradients

MODES = {
    "full": dict(mode="full"),
    "selective": dict(mode="selective", policy="matmuls"),
    "offload": dict(mode="offload"),
    "auto-budget": dict(mode="auto", budget=1.0),  # the whole peak: every layer kept
    "segments": dict(mode="full", segments=2),
    "every_n": dict(mode="full", every_n=2),
}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_accepts_auto(mode: str) -> None:
    keys = MODES[mode]
    model = small_gpt()
    plan = plan_for(model, make_config(layers="auto", **keys))
    assert plan.note == GPT_NOTE
    assert plan.summary.splitlines()[0] == GPT_NOTE
    expected = {"auto-budget": [], "every_n": ["blocks.1", "blocks.3"]}.get(mode, BLOCKS)
    assert install(model, plan) == wrapped_modules(model) == expected  # apply_checkpointing, without planning twice
    if mode == "auto-budget":  # the planner's table follows the note; wrapping nothing is said, too
        assert plan.summary.splitlines()[1] == "ckpt=auto plan:"
        assert re.fullmatch(r"ckpt\.budget=1\.0 is at least the activation peak without checkpointing "
                            r"\([0-9.]+ [KM]iB\): every layer is kept, none is wrapped", plan.summary.splitlines()[-1])


def _gpt2_grads(checkpointed: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one training step of the tiny GPT2, and how often its first attention ran."""
    model = tiny_gpt2()
    model.train()  # dropout on: the recomputation must replay the same masks
    calls = []
    model.transformer.h[0].attn.register_forward_hook(lambda *_: calls.append(1))
    if checkpointed:
        assert apply_checkpointing(model, layers="auto") == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, len(calls)


def test_hf_gpt2_gradients_bitwise_equal_to_no_checkpointing() -> None:
    (plain, plain_calls), (ckpt, ckpt_calls) = _gpt2_grads(False), _gpt2_grads(True)
    assert (plain_calls, ckpt_calls) == (1, 2)  # checkpointed: run again in backward
    assert plain.keys() == ckpt.keys()
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name

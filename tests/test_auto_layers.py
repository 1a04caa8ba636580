"""``ckpt.layers=auto``: the model's repeated block, chosen without configuration, and said.

Hugging Face models are built from configs (nothing downloaded) and choose the
layers Hugging Face checkpoints itself; every other model, its repeated blocks
(``engine/blocks.py``), shown here on the shapes outside libraries give them.
The zoo of outside models is ``tests/test_zoo.py``. Each choice is checked by name and by the exact note the
plan and the report carry; one case trains and compares gradients bit for bit
with no checkpointing; every mode accepts ``auto``.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ckpt_plugin import ConfigError, apply_checkpointing, make_config, wrapped_modules
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.engine.selection import resolve_layers, select_layers
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.measure.report import wrap_report
from conftest import small_gpt

transformers = pytest.importorskip("transformers")

BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
GPT_NOTE = "ckpt.layers=auto chose TransformerBlock (repeated blocks): 4 modules"


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
        self.fc1, self.fc2 = nn.Linear(self.width, self.width), nn.Linear(self.width, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Block(_Residual):
    pass


class Other(_Residual):
    """As big as a Block, by another name."""


class Wide(_Residual):
    width = 16


# ---------------------------------------------------------------------- what auto chooses

def test_hf_gpt2_chooses_its_checkpointing_layer() -> None:
    model = tiny_gpt2()
    assert resolve_layers(model, "auto") == (
        ("GPT2Block",), "ckpt.layers=auto chose GPT2Block (HF GradientCheckpointingLayer): 3 modules")
    assert apply_checkpointing(model, layers="auto") == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_hf_llama_chooses_its_decoder_layer() -> None:
    model = tiny_llama()
    assert resolve_layers(model, "auto") == (
        ("LlamaDecoderLayer",), "ckpt.layers=auto chose LlamaDecoderLayer (HF GradientCheckpointingLayer): 2 modules")
    assert select_layers(model, "auto") == ["model.layers.0", "model.layers.1"]


def test_the_example_gpt_chooses_its_transformer_block() -> None:
    model = small_gpt()
    assert resolve_layers(model, "auto") == (("TransformerBlock",), GPT_NOTE)
    assert apply_checkpointing(model, layers="auto") == BLOCKS


def test_a_sequential_of_identical_blocks() -> None:
    # ResNet-like: the model itself is the stack; a Sequential inside a block holds no run.
    model = nn.Sequential(nn.Conv2d(3, 8, 3), *(Block() for _ in range(5)), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert resolve_layers(model, "auto") == (("Block",), "ckpt.layers=auto chose Block (repeated blocks): 5 modules")
    assert apply_checkpointing(model, layers="auto") == ["1", "2", "3", "4", "5"]


class TwoStacks(nn.Module):
    def __init__(self, first: list[nn.Module], second: list[nn.Module]) -> None:
        super().__init__()
        self.first, self.second = nn.ModuleList(first), nn.Sequential(*second)


def test_every_stack_is_covered() -> None:
    # An encoder and a decoder of other classes and lengths: both, not the longer alone (Pegasus, Marian).
    model = TwoStacks([Wide(), Wide()], [Block(), Block(), Block()])
    assert resolve_layers(model, "auto") == (
        ("Wide", "Block"), "ckpt.layers=auto chose Wide, Block (repeated blocks): 5 modules")
    assert select_layers(model, "auto") == ["first.0", "first.1", "second.0", "second.1", "second.2"]


def test_a_stack_of_alternating_classes_is_covered_whole() -> None:
    # Hybrid stacks (a Mamba layer, an attention layer, ...): every block of the stack, not one class of it.
    model = TwoStacks([Block(), Wide(), Block(), Wide(), Block()], [])
    assert select_layers(model, "auto") == [f"first.{i}" for i in range(5)]


class Stage(nn.Module):
    """Blocks as named children b1, b2 of a plain module (timm's RegNet stage), before a downsampling."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", TwoLayerBlock())
        self.down = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in list(self.children())[:-1]:
            x = block(x)
        return self.down(x)


class LinearAct(nn.Module):
    """One weighted layer and its activation: a piece of a block, as timm's ConvNormAct."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class TwoLayerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = LinearAct(), LinearAct()  # a series of pieces: the block is still this

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.conv1(x))


def test_blocks_inside_sequential_stages_inside_a_sequential() -> None:
    # The reproduction of timm's EfficientNet: the stages are containers, never the block.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(Block(), Block()) for _ in range(3)])

    assert select_layers(Net(), "auto") == [f"blocks.{s}.{b}" for s in range(3) for b in range(2)]


def test_blocks_as_named_children_of_plain_stages() -> None:
    # timm's RegNet: stages s1, s2 hold blocks b1, b2, ...; a block's own conv1, conv2 are not blocks.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = LinearAct()
            self.s1, self.s2 = Stage(2), Stage(3)

    assert resolve_layers(Net(), "auto") == (
        ("TwoLayerBlock",), "ckpt.layers=auto chose TwoLayerBlock (repeated blocks): 5 modules")
    assert select_layers(Net(), "auto") == ["s1.b1", "s1.b2", "s2.b1", "s2.b2", "s2.b3"]


def test_one_block_per_stage_is_a_stack_across_stages() -> None:
    # ResNeSt-14: every stage an nn.Sequential of one block; flattened, the blocks follow each other.
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Sequential(TwoLayerBlock()), nn.Sequential(TwoLayerBlock()))
    assert select_layers(model, "auto") == ["1.0", "2.0"]


def test_a_stage_holding_a_container_of_blocks_is_walked_into() -> None:
    # Swin, DenseNet: a stage (a class of its own, repeated) holding a ModuleList of blocks.
    class SwinStage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([TwoLayerBlock(), TwoLayerBlock()])
            self.downsample = LinearAct()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.downsample(x)

    model = nn.Sequential(SwinStage(), SwinStage())
    assert resolve_layers(model, "auto")[0] == ("TwoLayerBlock",)
    assert select_layers(model, "auto") == ["0.blocks.0", "0.blocks.1", "1.blocks.0", "1.blocks.1"]


def test_a_block_alone_in_a_container() -> None:
    # One layer called again and again (ALBERT), or a stack of depth one: still the block.
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.layers = nn.ModuleList([TwoLayerBlock()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = self.layers[0](x)
            return x

    assert resolve_layers(Shared(), "auto") == (
        ("TwoLayerBlock",), "ckpt.layers=auto chose TwoLayerBlock (a block alone in a ModuleList/Sequential): 1 module")


def test_hf_marked_layers_win_and_nest_to_the_innermost() -> None:
    # Hugging Face's marker, read by class name (transformers never imported): Swin marks its stages
    # and the layers inside them; its own checkpointing is the layers'.
    class GradientCheckpointingLayer(nn.Module):
        pass

    class MarkedStage(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([MarkedLayer(), MarkedLayer()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    class MarkedLayer(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = nn.Sequential(MarkedStage(), nn.Sequential(*(Block() for _ in range(4))))  # the longer run: unmarked
    assert resolve_layers(model, "auto") == (
        ("MarkedLayer",), "ckpt.layers=auto chose MarkedLayer (HF GradientCheckpointingLayer): 2 modules")


def test_a_stack_of_single_layer_pieces() -> None:
    # Nothing with two weighted layers repeats: the repeated one-layer modules are the blocks.
    model = nn.Sequential(*(LinearAct() for _ in range(3)), nn.Linear(8, 2))
    assert resolve_layers(model, "auto") == (
        ("LinearAct",), "ckpt.layers=auto chose LinearAct (repeated layers): 3 modules")


def test_declared_no_split_modules_only_when_the_structure_has_no_block() -> None:
    class Layer(nn.Module):  # no children: no block by structure
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    class Model(nn.Module):
        _no_split_modules = ["Layer", "NotInThisModel"]

        def __init__(self) -> None:
            super().__init__()
            self.a, self.gap, self.b = Layer(), nn.ReLU(), Layer()

    assert resolve_layers(Model(), "auto") == (
        ("Layer",), "ckpt.layers=auto chose Layer (HF _no_split_modules): 2 modules")
    with_blocks = TwoStacks([Block(), Block()], [])
    with_blocks._no_split_modules = ["Linear"]  # a placement hint loses to the structure's blocks
    assert resolve_layers(with_blocks, "auto")[0] == ("Block",)


class CrossBlock(nn.Module):
    """diffusers' BasicTransformerBlock: attn1, norm2, attn2, ff; two numbered parts of one block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn1, self.norm2, self.attn2 = nn.LayerNorm(8), Block(), nn.LayerNorm(8), Block()
        self.ff = Other()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.attn2(self.norm2(self.attn1(self.norm1(x)))))


def test_two_numbered_parts_apart_are_no_series() -> None:
    # Issue #33: attn1 and attn2 had made the block a stage, and auto wrapped the attentions (PixArt: 2.59x
    # diffusers' peak). Two numbered apart are parts of one block; side by side (RegNet's b1, b2) a series.
    model = nn.Sequential(nn.Linear(8, 8), CrossBlock(), CrossBlock())
    assert resolve_layers(model, "auto") == (
        ("CrossBlock",), "ckpt.layers=auto chose CrossBlock (repeated blocks): 2 modules")
    assert select_layers(nn.Sequential(Stage(2), Stage(2)), "auto") == ["0.b1", "0.b2", "1.b1", "1.b2"]


class _Caller(nn.Module):
    """A module diffusers' enable_gradient_checkpointing() switches on: a boolean ``gradient_checkpointing``."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PixArtLike(_Caller):
    _supports_gradient_checkpointing = True  # ModelMixin's flag: read by name, diffusers is never imported


class TransformerLike(PixArtLike):
    """A diffusers model inside a UNet block (Transformer2DModel): it checkpoints its own blocks."""


DownLike, MidLike, CoderLike = (type(name, (_Caller,), {}) for name in ("DownLike", "MidLike", "CoderLike"))


def test_diffusers_checkpointing_callers_choose_the_blocks() -> None:
    # The model itself checkpoints its blocks; its one-off embedder (Wide: two weighted layers) runs outside.
    model = PixArtLike(embed=Wide(), blocks=nn.ModuleList([CrossBlock(), CrossBlock()]))
    assert resolve_layers(model, "auto") == (
        ("CrossBlock",), "ckpt.layers=auto chose CrossBlock (diffusers gradient_checkpointing): 2 modules")
    # A UNet's down blocks checkpoint their resnets, the Transformer2DModel beside them its own blocks;
    # a VAE's Encoder and Decoder their blocks and their mid block whole (outermost: not its resnets again).
    def down() -> nn.Module:
        return DownLike(resnets=nn.ModuleList([Block()]), attentions=nn.ModuleList([
            TransformerLike(proj_in=nn.Linear(8, 8), transformer_blocks=nn.ModuleList([CrossBlock()]))]))

    def coder() -> nn.Module:
        return CoderLike(conv_in=nn.Linear(8, 8), blocks=nn.ModuleList([Block(), Block()]),
                         mid=MidLike(resnets=nn.ModuleList([Block(), Block()]), attn=Other()))

    class UNetAndVAE(nn.Module):
        _supports_gradient_checkpointing = True

        def __init__(self) -> None:
            super().__init__()
            self.time_embedding = Wide()  # no caller holds it
            self.down = nn.ModuleList([down(), down()])
            self.encoder, self.decoder = coder(), coder()

    assert resolve_layers(UNetAndVAE(), "auto") == (("Block", "CrossBlock", "MidLike"), (
        "ckpt.layers=auto chose Block, CrossBlock, MidLike (diffusers gradient_checkpointing): 10 modules"))
    assert select_layers(UNetAndVAE(), "auto") == [
        "down.0.resnets.0", "down.0.attentions.0.transformer_blocks.0",
        "down.1.resnets.0", "down.1.attentions.0.transformer_blocks.0",
        "encoder.blocks.0", "encoder.blocks.1", "encoder.mid", "decoder.blocks.0", "decoder.blocks.1", "decoder.mid"]


def test_no_repeated_block_is_an_error_naming_what_was_looked_for() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)  # repeated, but leaves: no block
            self.mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))

    message = (
        "ckpt.layers=auto found no repeated block in Net: no module subclasses Hugging Face's "
        "GradientCheckpointingLayer, and no two modules of one class (with a forward and submodules) sit side by "
        "side or in one nn.ModuleList, nn.Sequential or nn.ModuleDict; name the layers instead (a class name, a "
        "module name or a glob such as 'blocks.*'); class names in this model, most instances first: Linear, Net, "
        "ReLU, Sequential"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        apply_checkpointing(Net(), layers="auto")


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
    assert lines[1] == ("Activation checkpointing wrapped 4 module(s) of GPT (ckpt=full); kept for backward after one "
                        "forward:")
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

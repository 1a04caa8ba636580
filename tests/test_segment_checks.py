"""``ckpt.segments`` over layers that are not a chain: refused when applied, not at the first step (issue #20).

Where the layers sit is checked before anything runs: a chain never runs on from
one layer list into an unrelated one (BART's encoder into its decoder, two
ModuleLists of a plain forward, Swin's blocks across a SwinStage), nor skips the
last block of a stage. What the layers get (tuple outputs, other arguments) is
checked on the model's sample input, one forward on fake tensors through the very
check the chain runs on every call. Either way a ``ConfigError`` naming the
first break, the model untouched. Legitimate chains (the example ResNet's
Bottlenecks across stages: ``test_segments.py``; BART's encoder layers, here) are
accepted and exact. Tiny models built in code; nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import small_resnet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_plugin import (
    ActivationCheckpointing,
    ConfigError,
    apply_checkpointing,
    remove_checkpointing,
    wrapped_modules,
)

ENC, DEC = "model.encoder.layers", "model.decoder.layers"
NO = "set ckpt.segments=null to checkpoint each layer"
IDS = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def hf():
    return pytest.importorskip("transformers")


def bart(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = hf().BartConfig(vocab_size=64, d_model=16, encoder_layers=4, decoder_layers=2, encoder_attention_heads=2,
                             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                             max_position_embeddings=32, use_cache=False)  # dropout 0.1: replayed (preserve_rng_state)
    return hf().BartForConditionalGeneration(config).train()


def swin() -> nn.Module:
    torch.manual_seed(0)
    config = hf().SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4,
                             num_labels=3)
    return hf().SwinForImageClassification(config).train()


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def refused(model: nn.Module, message: str, **keys) -> None:
    """``apply_checkpointing(model, **keys)`` raises exactly ``message`` and leaves ``model`` as it was."""
    before, state = (wrapped_modules(model), hooks(model)), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        apply_checkpointing(model, **keys)
    assert (wrapped_modules(model), hooks(model)) == before
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def not_one_chain(n: int, a: str, b: str, why: str, fix: str) -> str:
    return (f"ckpt.segments: the {n} selected layers are not one chain: {b} comes after {a} but in another list, and "
            f"{why}, so nothing says {b} takes {a}'s output; segments run over one chain: {fix}")


def not_a_chain(later: str, earlier: str, got: str, model: str, fix: str) -> str:
    return (f"ckpt.segments: {later} did not take {earlier}'s output as its one input (it {got}) in a forward of "
            f"{model} on its sample input, so these layers are not a chain and a segment cannot be recomputed from "
            f"its first input; segments need layers that feed each other one tensor and all get the same other "
            f"arguments: {fix}")


# ----------------------------------------------------------------------------- where the layers sit


@pytest.mark.parametrize("segments", ["sqrt", 2, "recursive"])
def test_bart_encoder_and_decoder_layers_are_two_chains(segments) -> None:
    refused(bart(), not_one_chain(
        6, f"{ENC}.3", f"{DEC}.0",
        f"{ENC} is a child of model.encoder (BartEncoder), not of an nn.Sequential or nn.ModuleList",
        f"select one, ckpt.layers='{ENC}.*' or ckpt.layers='{DEC}.*', or {NO}"),
        layers=["BartEncoderLayer", "BartDecoderLayer"], segments=segments)


def test_bart_encoder_layers_alone_are_a_chain_and_exact() -> None:
    def step(model):
        torch.manual_seed(3)
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    plain, ours = bart(), bart()
    ours.example_input_array = {"input_ids": IDS, "labels": IDS}  # checked on it too: the calls chain
    assert apply_checkpointing(ours, layers=f"{ENC}.*", segments=2) == [f"{ENC}.{i}" for i in range(4)]
    (loss, grads), (our_loss, our_grads) = step(plain), step(ours)
    assert torch.equal(loss, our_loss) and all(torch.equal(a, b) for a, b in zip(grads, our_grads, strict=True))


class TwoLists(nn.Module):
    """Two ModuleLists that a plain forward runs one after the other: the containers say nothing of it."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.up = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.down, *self.up]:
            x = layer(x)
        return x


def test_two_module_lists_of_a_plain_forward_are_refused_and_an_earlier_wrapping_stays() -> None:
    model = TwoLists()
    assert apply_checkpointing(model, layers="down.*", segments=1) == ["down.0", "down.1"]
    refused(model, not_one_chain(
        4, "down.1", "up.0", "down and up meet in the model (TwoLists), not in an nn.Sequential or nn.ModuleList",
        f"select one, ckpt.layers='down.*' or ckpt.layers='up.*', or {NO}"),
        layers="Linear", segments=2)
    assert wrapped_modules(model) == ["down.0", "down.1"]


def test_swin_blocks_across_a_stage_are_refused() -> None:
    a, b = "swin.encoder.layers.0.blocks", "swin.encoder.layers.1.blocks"
    refused(swin(), not_one_chain(
        4, f"{a}.1", f"{b}.0",
        f"{a} is a child of swin.encoder.layers.0 (SwinStage), not of an nn.Sequential or nn.ModuleList",
        f"select one, ckpt.layers='{a}.*' or ckpt.layers='{b}.*', or {NO}"),
        layers="SwinLayer", segments=2)


@pytest.mark.parametrize(("layers", "n", "a", "b", "why", "fix"), [
    (["stages.0.0", "stages.1.*"], 3, "stages.0.0", "stages.1.0",
     "stages.0.0 is not the last child of stages.0 (stages.0.1 follows it)",
     f"ckpt.layers='stages.1.*', or {NO}"),
    (["stages.0.*", "stages.1.1"], 3, "stages.0.1", "stages.1.1",
     "stages.1.1 is not the first child of stages.1 (stages.1.0 precedes it)",
     f"ckpt.layers='stages.0.*', or {NO}"),
    (["stages.0.*", "stages.2.*"], 4, "stages.0.1", "stages.2.0",
     "stages.0 and stages.2 meet in stages, where stages.1 runs between stages.0 and stages.2",
     f"select one, ckpt.layers='stages.0.*' or ckpt.layers='stages.2.*', or {NO}"),
], ids=["last block left out", "first block left out", "a stage left out"])
def test_a_chain_across_resnet_stages_that_skips_a_block_is_refused(layers, n, a, b, why, fix) -> None:
    """The example ResNet's Bottlenecks chain across stages (``test_segments.py``), but only without a gap."""
    model = small_resnet(depths=(2, 2, 2))
    refused(model, not_one_chain(n, a, b, why, fix), layers=layers, segments=1)


# ----------------------------------------------------------------------------- what the layers get, on a sample


def test_swin_stages_are_refused_on_a_sample_input() -> None:
    model = swin()
    model.example_input_array = torch.randn(2, 3, 32, 32)
    refused(model, not_a_chain(
        "swin.encoder.layers.1", "swin.encoder.layers.0", "got item 0 of that output, a tuple of 3",
        "SwinForImageClassification", NO),
        layers="SwinStage", segments=2)


class Pairs(nn.Module):
    """Layers returning (y, aux): the parent passes y on, so the next layer never gets a layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.fc(x))
        return y, y.mean()


class PairNet(pl.LightningModule):
    def __init__(self, sample: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Pairs() for _ in range(3))
        self.example_input_array = torch.zeros(2, 4) if sample else None
        self.optimizers_configured = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _ = block(x)
        return x

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizers_configured = True
        return torch.optim.SGD(self.parameters(), lr=0.1)


PAIRS = {"later": "blocks.1", "earlier": "blocks.0", "got": "got item 0 of that output, a tuple of 2"}


def first_step_refused(model: nn.Module, layers: str, got: str) -> None:
    """Segments over ``layers`` of ``model`` (no sample): the first forward raises, naming how blocks.1 broke the
    chain; then unwrapped."""
    apply_checkpointing(model, layers=layers, segments=1)
    with pytest.raises(RuntimeError, match="^" + re.escape(
            f"ckpt.segments: blocks.1 did not take blocks.0's output as its one input (it {got}), so these layers "
            "are not a chain")):
        model(torch.zeros(2, 4, requires_grad=True))
    remove_checkpointing(model)


def test_the_sample_check_and_the_step_check_are_one_check() -> None:
    """Without a sample the first forward raises; with one, apply does, naming the same break."""
    first_step_refused(PairNet(sample=False), "Pairs", PAIRS["got"])
    refused(PairNet(), not_a_chain(**PAIRS, model="PairNet", fix=NO),
            layers="Pairs", segments=1)


class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # ends in the linear layer: nothing saves its output
        return self.fc(torch.tanh(x))


class ScaledInPlace(nn.Module):
    """Scales each layer's output in place before the next takes it: the same tensor, another value. A segment's
    recomputation replays the layers alone, without the scaling, so its gradients would be wrong."""

    def __init__(self, sample: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Projection() for _ in range(3))
        self.example_input_array = torch.zeros(2, 4) if sample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            x.mul_(0.5)
        return x


def test_an_output_written_in_place_before_the_next_layer_takes_it_is_refused() -> None:
    got = "got that output written in place after blocks.0 returned it"
    refused(ScaledInPlace(), not_a_chain("blocks.1", "blocks.0", got, "ScaledInPlace", NO),
            layers="Projection", segments=1)
    model = ScaledInPlace(sample=False)
    first_step_refused(model, "Projection", got)
    apply_checkpointing(model, layers="Projection")  # each layer on its own: exact
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    plain = ScaledInPlace(sample=False)
    plain(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


def test_the_callback_refuses_at_setup_before_configure_optimizers(tmp_path: Path) -> None:
    model = PairNet()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[ActivationCheckpointing(layers="Pairs", segments=1)])
    data = DataLoader(TensorDataset(torch.zeros(4, 4)), batch_size=2)
    with pytest.raises(ConfigError, match="^" + re.escape(not_a_chain(
            **PAIRS, model="PairNet", fix=NO)) + "$"):
        trainer.fit(model, data)
    assert not model.optimizers_configured and wrapped_modules(model) == []


class ThreeAndOne(nn.Module):
    """Three layers chained, a fourth given the third's output plus one: a run of three, and one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:3]:
            x = block(x)
        return x + self.blocks[3](x + 1)


def test_the_layers_that_do_chain_on_the_sample_are_named() -> None:
    refused(ThreeAndOne(), not_a_chain(
        "blocks.3", "blocks.2", "got a different value", "ThreeAndOne",
        f"ckpt.layers=['blocks.0', 'blocks.1', 'blocks.2'], or {NO}"), layers="blocks.*", segments=2)


class Branchy(nn.Module):
    """A chain whose forward reads a value (``.item()``): it cannot run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
        self.example_input_array = torch.ones(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) if x.sum().item() > 0 else x


def test_a_sample_that_cannot_run_on_fake_tensors_leaves_the_check_to_the_step() -> None:
    plain, model = Branchy(), Branchy()
    model.load_state_dict(plain.state_dict())
    assert apply_checkpointing(model, layers="blocks.*", segments=1) == ["blocks.0", "blocks.1", "blocks.2"]
    x = torch.ones(2, 4)
    plain(x).sum().backward()
    model(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))

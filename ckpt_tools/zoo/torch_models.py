"""The zoo's models outside Hugging Face: torch's and Lightning's own, and shapes of vision libraries.

timm's own models are in the zoo now (``timm_models.py``, issue #42: real
EfficientNet, RegNet, ResNet, ConvNeXt, ViT, Swin and MobileNetV3, with timm's
own checkpointing). The shapes below were rebuilt in plain torch when timm could
not be installed here; the EfficientNet shape is gone (the real one covers it).
Those left test the general rule (``layers=auto`` on modules that carry no
library's mark: none has ``set_grad_checkpointing()``) on nestings the real
entries do not give it, and ``ckpt_tools/fit_check.py`` trains the RegNet one:

- ``regnet``: blocks as named children ``b1``, ``b2`` of plain-module stages
  (timm's RegNet), each block three conv-norm-acts;
- ``densenet``: dense layers ``denselayer1``... in an ``nn.ModuleDict`` with
  a forward of its own (torchvision's DenseNet), transitions between;
- ``resnest``: one block per stage, each stage an ``nn.Sequential`` (timm's
  ResNeSt-14): no stage holds two blocks;
- ``dla``: a recursive tree of blocks, ``tree1``/``tree2`` (timm's DLA).

These are our reconstructions of the nesting, not the libraries' code; the
``units`` are the blocks each library checkpoints (or would: DLA has none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_tools.zoo import ZooModel

IMAGE = 16  # pixels a side: small, enough for three downsamplings


def _images(classes: int = 5) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {"x": torch.randn(2, 3, IMAGE, IMAGE, generator=gen), "y": torch.randint(classes, (2,), generator=gen)}


class _Classifier(nn.Module):
    """``model(x=images, y=labels)`` -> cross-entropy; ``grad_checkpointing`` switches on the library's own."""

    grad_checkpointing = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.features(x).mean((2, 3))), y)


def _own(model: nn.Module) -> None:
    model.grad_checkpointing = True


class ConvNormAct(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a module of its own, as timm's ConvNormAct is
        return super().forward(x)


# ---------------------------------------------------------------------- RegNet: named children of a stage

class RegBottleneck(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = ConvNormAct(cin, cout, 1), ConvNormAct(cout, cout, 3, stride, groups=2)
        self.conv3 = ConvNormAct(cout, cout, 1)
        self.downsample = ConvNormAct(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.conv2(self.conv1(x))) + self.downsample(x)


class RegStage(nn.Module):
    def __init__(self, cin: int, cout: int, depth: int) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", RegBottleneck(cin if i == 0 else cout, cout, 2 if i == 0 else 1))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing else block(x)
        return x


class RegNetShape(_Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvNormAct(3, 8, 3, 2)
        self.s1, self.s2 = RegStage(8, 8, 2), RegStage(8, 16, 3)
        self.head = nn.Linear(16, 5)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.s2(self.s1(self.stem(x)))


def _regnet_own(model: nn.Module) -> None:
    model.s1.grad_checkpointing = model.s2.grad_checkpointing = True


# ---------------------------------------------------------------------- DenseNet: a ModuleDict with a forward

class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(2 * growth), nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)
        self.memory_efficient = False

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        def bottleneck(*inputs: torch.Tensor) -> torch.Tensor:
            return self.conv1(F.relu(self.norm1(torch.cat(inputs, 1))))

        # torchvision's memory_efficient: checkpoint the concatenation and the 1x1 conv only
        out = checkpoint(bottleneck, *features, use_reentrant=False) if self.memory_efficient else bottleneck(*features)
        return self.conv2(F.relu(self.norm2(out)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, cin: int, depth: int, growth: int) -> None:
        super().__init__({f"denselayer{i + 1}": DenseLayer(cin + i * growth, growth) for i in range(depth)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class DenseNetShape(_Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            ConvNormAct(3, 8, 3, 2),
            DenseBlock(8, 3, 4), Transition(20, 8),
            DenseBlock(8, 3, 4), nn.BatchNorm2d(20),
        )
        self.head = nn.Linear(20, 5)


def _densenet_own(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, DenseLayer):
            m.memory_efficient = True


# ---------------------------------------------------------------------- ResNeSt-14: one block per stage

class SplitBottleneck(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = ConvNormAct(cin, cout, 1), ConvNormAct(cout, 2 * cout, 3, stride, groups=2)
        self.fc = nn.Conv2d(cout, 2 * cout, 1)
        self.conv3 = nn.Conv2d(cout, cout, 1)
        self.downsample = nn.Conv2d(cin, cout, 1, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.conv2(self.conv1(x)).chunk(2, 1)  # split attention over two radix groups
        gate = self.fc(F.adaptive_avg_pool2d(a + b, 1)).view(x.shape[0], 2, -1, 1, 1).softmax(1)
        return self.conv3(a * gate[:, 0] + b * gate[:, 1]) + self.downsample(x)


class ResNeStShape(_Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvNormAct(3, 8, 3, 2)
        self.layer1, self.layer2 = nn.Sequential(SplitBottleneck(8, 8, 1)), nn.Sequential(SplitBottleneck(8, 16, 2))
        self.layer3 = nn.Sequential(SplitBottleneck(16, 16, 2))
        self.head = nn.Linear(16, 5)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in (*self.layer1, *self.layer2, *self.layer3):
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing else block(x)
        return x


# ---------------------------------------------------------------------- DLA: a tree of blocks

class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = ConvNormAct(c, c), ConvNormAct(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.conv1(x))


class Tree(nn.Module):
    def __init__(self, levels: int, c: int) -> None:
        super().__init__()
        self.tree1 = Tree(levels - 1, c) if levels > 1 else BasicBlock(c)
        self.tree2 = Tree(levels - 1, c) if levels > 1 else BasicBlock(c)
        self.root = ConvNormAct(2 * c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.tree1(x)
        return self.root(torch.cat([self.tree2(x1), x1], 1))


class DLAShape(_Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.base = ConvNormAct(3, 8, 3, 2)
        self.level2 = Tree(2, 8)
        self.head = nn.Linear(8, 5)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.level2(self.base(x))


# ---------------------------------------------------------------------- torch's and Lightning's own

class _Seq2Seq(nn.Module):
    """``nn.Transformer`` between two embeddings, called with source and target tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.transformer = nn.Transformer(16, 2, 2, 2, 32, dropout=0.1, batch_first=True)
        self.out = nn.Linear(16, 32)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return F.cross_entropy(self.out(h).flatten(0, 1), tgt.flatten())


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.out = nn.Linear(16, 32)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(self.encoder(self.embed(src))).flatten(0, 1), tgt.flatten())


def _tokens() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    return {"src": torch.randint(32, (2, 8), generator=gen), "tgt": torch.randint(32, (2, 8), generator=gen)}


def _lightning_demo() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=32, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.1)


def _demo_tokens() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"inputs": torch.randint(32, (2, 8), generator=gen), "target": torch.randint(32, (2, 8), generator=gen)}


def _demo_loss(output: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(output, _demo_tokens()["target"].flatten())  # the demo returns log-probabilities (B*T, vocab)


def _seeded(cls: Any) -> Any:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls().train()
    return build


def _identity(output: Any) -> torch.Tensor:
    return output


def models() -> list[ZooModel]:
    """torch's, Lightning's, and the vision libraries' shapes."""
    return [
        ZooModel("torch.transformer_encoder", "torch", _seeded(_Encoder), _tokens, _identity, None,
                 ("TransformerEncoderLayer",)),
        ZooModel("torch.transformer", "torch", _seeded(_Seq2Seq), _tokens, _identity, None,
                 ("TransformerEncoderLayer", "TransformerDecoderLayer")),
        ZooModel("lightning.demo_transformer", "torch", _seeded(_lightning_demo), _demo_tokens, _demo_loss, None,
                 ("TransformerEncoderLayer", "TransformerDecoderLayer")),
        ZooModel("shape.regnet", "shape", _seeded(RegNetShape), _images, _identity, _regnet_own, ("RegBottleneck",)),
        ZooModel("shape.densenet", "shape", _seeded(DenseNetShape), _images, _identity, _densenet_own,
                 ("DenseLayer",)),
        ZooModel("shape.resnest", "shape", _seeded(ResNeStShape), _images, _identity, _own, ("SplitBottleneck",)),
        ZooModel("shape.dla", "shape", _seeded(DLAShape), _images, _identity, None, ("BasicBlock",)),
    ]


__all__ = ["models"]

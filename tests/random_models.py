"""Random small models for the property tests (``test_properties.py``), as plain data.

A model is described by a :class:`ModelSpec` (frozen dataclasses, so
hypothesis prints and shrinks it) and built by :func:`build`; two builds of
one spec with one seed are identical, weights and inputs alike.

    spec = ModelSpec(blocks=(BlockSpec(kind="tuple", norm="batch"), BlockSpec(dropout=0.3)), shared=1)
    model = build(spec)            # RandomNet, float64
    x, target = inputs(spec)

What varies, all of it on purpose:

- depth, width, batch;
- per block: its calling convention (``kind``: ``mlp`` takes and returns one
  tensor, ``gated`` also takes keyword arguments, ``tuple`` and ``dict`` return
  a tuple and a dict), a residual around it in the parent (``mlp``), Dropout,
  LayerNorm or BatchNorm, a batched matmul, ``checkpoint_name`` tags, frozen
  parameters (all, or one sub-module);
- a block called twice in one forward (``shared``), a frozen stem, an input
  that requires grad or not, train or eval mode;
- user hooks and a forward set on an instance by "someone else";
- the container: a ``ModuleList``, an ``nn.Sequential`` (called as a whole when
  ``via_container``) or two stages of ``nn.Sequential`` in a ``ModuleList``.

:func:`expected_selection` is an independent oracle for what ``ckpt.layers``
and ``ckpt.every_n`` select (README, "How an entry of layers is read").
"""

from __future__ import annotations

import fnmatch
import importlib
import re
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ckpt_plugin import checkpoint_name

TAGS = ("fc1", "act", "out")  # the checkpoint_name tags a block with tags=True uses
KINDS = ("mlp", "gated", "tuple", "dict")


@dataclass(frozen=True)
class BlockSpec:
    kind: str = "mlp"  # mlp | gated (keyword arguments) | tuple | dict (outputs)
    residual: bool = False  # mlp only: the parent calls h = h + block(h)
    norm: str | None = None  # None | "layer" | "batch"
    dropout: float = 0.0
    bmm: bool = False  # a batched matmul inside (matmuls saves it, matmuls_no_batch does not)
    tags: bool = False  # checkpoint_name tags fc1, act, out
    frozen: str = "none"  # none | all | fc1 (requires_grad=False)


@dataclass(frozen=True)
class ModelSpec:
    blocks: tuple[BlockSpec, ...] = (BlockSpec(),)
    width: int = 4
    batch: int = 3
    container: str = "modulelist"  # modulelist | sequential | stages
    via_container: bool = False  # forward calls the container(s) as a whole (a pure chain)
    shared: int | None = None  # this block is called a second time, right after its first call
    frozen_stem: bool = False
    input_grad: bool = False
    train: bool = True
    hooked: tuple[int, ...] = ()  # blocks with a user forward hook and forward pre-hook
    own_forward: int | None = None  # a block whose forward was set on the instance before wrapping
    seed: int = 0
    names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(block_names(self)))

    @property
    def has_dropout(self) -> bool:
        return self.train and any(b.dropout for b in self.blocks)

    def calls(self) -> list[int]:
        """The blocks in the order the forward calls them."""
        order = []
        for i in range(len(self.blocks)):
            order += [i, i] if i == self.shared else [i]
        return order


def stage_split(n: int) -> list[list[int]]:
    first = (n + 1) // 2
    return [list(range(first)), list(range(first, n))] if n > 1 else [[0]]


def block_names(spec: ModelSpec) -> list[str]:
    if spec.container != "stages":
        return [f"blocks.{i}" for i in range(len(spec.blocks))]
    return [f"stages.{s}.{j}" for s, idx in enumerate(stage_split(len(spec.blocks))) for j in range(len(idx))]


# --------------------------------------------------------------------------- the blocks


class _Block(nn.Module):
    def __init__(self, spec: BlockSpec, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(spec.dropout) if spec.dropout else None
        self.fc2 = nn.Linear(2 * width, width)
        self.norm = {None: None, "layer": nn.LayerNorm(width), "batch": nn.BatchNorm1d(width)}[spec.norm]
        self.tags, self.bmm = spec.tags, spec.bmm
        if spec.frozen == "all":
            self.requires_grad_(False)
        elif spec.frozen == "fc1":
            self.fc1.requires_grad_(False)

    def _tag(self, h: torch.Tensor, name: str) -> torch.Tensor:
        return checkpoint_name(h, name) if self.tags else h

    def body(self, x: torch.Tensor) -> torch.Tensor:  # (B, W) -> (B, W)
        h = self._tag(self.fc1(x), "fc1")  # (B, 2W)
        h = self._tag(torch.tanh(h), "act")
        if self.drop is not None:
            h = self.drop(h)
        if self.bmm:
            h = h + 0.1 * torch.bmm(h.unsqueeze(2), h.unsqueeze(1)).mean(-1)  # (B, 2W, 1) @ (B, 1, 2W)
        h = self.fc2(h)
        if self.norm is not None:
            h = self.norm(h)
        return self._tag(h, "out")


class MLPBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class GatedBlock(_Block):
    def forward(self, x: torch.Tensor, *, gate: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.body(x) * gate * scale


class TupleBlock(_Block):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x), torch.sigmoid(x.sum(-1, keepdim=True))  # (B, W), (B, 1)


class DictBlock(_Block):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.body(x), "skip": x}


CLASSES = {"mlp": MLPBlock, "gated": GatedBlock, "tuple": TupleBlock, "dict": DictBlock}


def _noop_hook(*_args: object) -> None:
    return None


class RandomNet(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        w = spec.width
        self.stem = nn.Linear(w, w)
        if spec.frozen_stem:
            self.stem.requires_grad_(False)
        blocks = [CLASSES[b.kind](b, w) for b in spec.blocks]
        if spec.container == "stages":
            self.stages = nn.ModuleList(nn.Sequential(*(blocks[i] for i in idx)) for idx in stage_split(len(blocks)))
        else:
            self.blocks = nn.Sequential(*blocks) if spec.container == "sequential" else nn.ModuleList(blocks)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, w))  # reaches gated blocks as a keyword argument
        self.head = nn.Linear(w, 2)
        self.spec = spec
        self.flat = blocks  # a plain list: not registered twice
        for i in spec.hooked:
            blocks[i].register_forward_pre_hook(_noop_hook)
            blocks[i].register_forward_hook(_noop_hook)
        if spec.own_forward is not None:  # as another library would: an instance-level forward
            b = blocks[spec.own_forward]
            b.forward = types.MethodType(type(b).forward, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, W) -> (B, 2)
        h = self.stem(x)
        if self.spec.via_container:
            for container in self.stages if self.spec.container == "stages" else [self.blocks]:
                h = container(h)
            return self.head(h)
        for i in self.spec.calls():
            block, kind = self.flat[i], self.spec.blocks[i]
            if kind.kind == "mlp":
                h = h + block(h) if kind.residual else block(h)
            elif kind.kind == "gated":
                h = block(h, gate=torch.sigmoid(self.gate), scale=0.5)
            elif kind.kind == "tuple":
                y, aux = block(h)
                h = y + aux
            else:
                out = block(h)
                h = out["out"] + 0.5 * out["skip"]
        return self.head(h)


def build(spec: ModelSpec) -> RandomNet:
    torch.manual_seed(spec.seed)
    model = RandomNet(spec).double()
    model.train(spec.train)
    model.example_input_array = inputs(spec)[0]  # for ckpt=auto
    return model


def inputs(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.width, generator=g, dtype=torch.float64)
    target = torch.randn(spec.batch, 2, generator=g, dtype=torch.float64)
    return x.requires_grad_(spec.input_grad), target


def is_chain_call(spec: ModelSpec, i: int) -> bool:
    """Whether the parent calls block ``i`` as ``h = block(h)`` (one tensor in, the same out), once."""
    b = spec.blocks[i]
    return b.kind == "mlp" and not b.residual and spec.shared != i


# --------------------------------------------------------------------------- the selection oracle


def expected_selection(model: nn.Module, layers: str | list[str], every_n: int = 1) -> list[str]:
    """What ``ckpt.layers``/``ckpt.every_n`` select, written from the README, not from selection.py.

    Raises ``LookupError`` when an entry matches nothing (the package raises ValueError then).
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    modules = dict(named)
    chosen: set[str] = set()
    for text in [layers] if isinstance(layers, str) else layers:
        if text.startswith("re:"):
            hits = {n for n in names if re.fullmatch(text[3:], n)}
        elif any(c in text for c in "*?["):
            hits = {n for n in names if fnmatch.fnmatchcase(n, text)}
        elif text in names:  # a module's own name first, a plain word ("head") too
            hits = {text}
        elif "." not in text:
            hits = {n for n, m in named if text in [c.__name__ for c in type(m).__mro__]}
        else:
            module, _, attr = text.rpartition(".")
            cls = getattr(importlib.import_module(module), attr)
            hits = {n for n, m in named if isinstance(m, cls)}
        # A container without a forward (ModuleList) is never called: never a layer, and an entry
        # that selects only such containers is an error.
        hits = {n for n in hits if type(modules[n]).forward is not nn.Module.forward}
        if not hits:
            raise LookupError(text)
        chosen |= hits
    outer = [n for n in names if n in chosen and not any(n.startswith(c + ".") for c in chosen)]
    return outer[every_n - 1 :: every_n]

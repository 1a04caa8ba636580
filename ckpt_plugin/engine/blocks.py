"""``ckpt.layers=auto``: which modules of any model are "the block".

Rules, tried in turn; the first that finds anything decides:

1. **What the library checkpoints itself.** A Hugging Face model marks its
   checkpointing units by subclassing ``GradientCheckpointingLayer``
   (``transformers.modeling_layers``; ``gradient_checkpointing_enable()``
   checkpoints exactly those). Every marked module is a block, the innermost
   ones where marked modules nest (Swin marks each stage *and* each layer in
   it: the layers). Read from class names, so transformers is never imported.
   A diffusers model (its class sets ``_supports_gradient_checkpointing``)
   marks the *callers* instead: ``enable_gradient_checkpointing()`` sets the
   boolean ``gradient_checkpointing`` on every module that has one, and those
   run some of their children through ``self._gradient_checkpointing_func``
   (``ModelMixin._set_gradient_checkpointing``). The children so called are
   the repeated blocks among such a caller's children (see
   :func:`_diffusers_blocks`), outermost where they nest: the VAE's Encoder
   checkpoints its mid block whole, the mid block its resnets again inside.
   Read from attribute names, so diffusers is never imported.
   A timm model (a module with ``set_grad_checkpointing()``) marks its callers
   the same way, with a boolean ``grad_checkpointing``, and each runs one
   sequence of its children through ``checkpoint_seq`` (every element its own
   checkpoint) or ``checkpoint``: the blocks it holds in containers (EfficientNet
   and MobileNetV3 their ``blocks`` stages flattened, ResNet ``layer1``-``layer4``
   flattened, ConvNeXt, Swin and ViT their ``blocks``), else its numbered
   children (a RegNet stage's ``b1``, ``b2``...): see :func:`_timm_blocks`.
   Read from attribute names, so timm is never imported.
2. **The repeated blocks of the structure**, for any other model. The model
   is walked from its root, looking through the containers whose forward
   only runs their children in turn (``nn.Sequential``, ``nn.ModuleList``,
   ``nn.ModuleDict``), so nested stacks (timm's EfficientNet keeps its
   blocks in ``nn.Sequential`` stages inside an ``nn.Sequential``) are one
   flat list of siblings. A *block* has a forward of its own, two or more
   layers with weights of their own (norms aside: a conv-norm-act is a piece
   of a block), and a sibling of its class in one series: in a container,
   numbered children of one name (RegNet's ``b1``, ``b2``; DenseNet's
   ``denselayer1``...), or right beside it. Two numbered children apart
   (``attn1``, ``norm2``, ``attn2`` in diffusers' ``BasicTransformerBlock``)
   are two parts of one block, not a series: a numbered series is three or
   more, or two side by side. A block that itself holds a
   series of blocks is a *stage* (a Swin stage, a RegNet stage, a dense
   block) and is walked into. Every block found, in every stack (encoder
   *and* decoder), is chosen.
3. **A block alone in a container**: a stack of depth one, or one layer a
   loop calls again and again (ALBERT shares one layer across its depth);
   the innermost.
4. **Repeated layers**: rule 2 for modules with one weighted layer (a plain
   stack of conv-norm-acts).
5. **Hugging Face's ``_no_split_modules``**, the classes accelerate keeps on
   one device, if they occur more than once: a placement hint, used only
   when the structure shows nothing.

The chosen blocks' classes are returned; selecting them (``ckpt.layers`` as
class names) takes every instance, outermost where they nest.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from ckpt_plugin.errors import Problem

HF_MARK = "GradientCheckpointingLayer"  # transformers.modeling_layers: HF's own checkpointing unit
DIFFUSERS_MARK = "_supports_gradient_checkpointing"  # diffusers' ModelMixin: enable_gradient_checkpointing() works
TIMM_MARK = "set_grad_checkpointing"  # timm's switch; the modules it turns on carry a boolean grad_checkpointing
_STACKS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def has_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward of its own (a ModuleList or ModuleDict has none)."""
    return type(module).forward is not nn.Module.forward


def _passes_through(module: nn.Module) -> bool:
    """A container whose calls only run its children in turn (or that is never called)."""
    if isinstance(module, nn.Sequential):
        return type(module).forward is nn.Sequential.forward
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and not has_forward(module)


@dataclass(frozen=True)
class _Sibling:
    name: str  # its name in the module that holds it
    module: nn.Module
    stacked: bool  # reached through a container, not as a named child of the parent itself

    def numbered(self) -> tuple[str, str] | None:
        """``("b", "2")`` for ``b2``, ``("denselayer", "1")`` for ``denselayer1``: a named child of a series."""
        match = _NUMBERED.fullmatch(self.name)
        return (match[1], match[2]) if match else None


_NUMBERED = re.compile(r"(.*?[A-Za-z_])([0-9]+)")


def _siblings(parent: nn.Module) -> list[_Sibling]:
    """``parent``'s children in registration order, containers that only pass through flattened."""
    found: list[_Sibling] = []

    def visit(module: nn.Module, stacked: bool) -> None:
        for name, child in module.named_children():
            if _passes_through(child):
                visit(child, True)
            else:
                found.append(_Sibling(name, child, stacked))

    visit(parent, isinstance(parent, _STACKS))
    return found


def _series(siblings: list[_Sibling], i: int, j: int) -> bool:
    """Siblings ``i`` and ``j`` (of one class) are one series: in a container, or numbered children of one
    name, three or more of them or two side by side (RegNet's ``b1``, ``b2``). Two numbered apart are
    parts of one block: ``attn1``, ``norm2``, ``attn2`` in diffusers' ``BasicTransformerBlock``."""
    a, b = siblings[i], siblings[j]
    if a.stacked and b.stacked:
        return True
    na, nb = a.numbered(), b.numbered()
    if na is None or nb is None or na[0] != nb[0]:
        return False
    named = sum(1 for o in siblings if (n := o.numbered()) is not None and n[0] == na[0])
    return named >= 3 or abs(i - j) == 1


def _units(siblings: list[_Sibling], weighted: int = 1) -> list[int]:
    """Indices of the siblings that are units: own forward, children, ``weighted`` or more weighted
    layers, and a sibling of their class in the same series or right beside them."""
    out = []
    for i, s in enumerate(siblings):
        m = s.module
        if not has_forward(m) or next(m.children(), None) is None or _layers_with_weights(m) < weighted:
            continue
        same = [j for j, o in enumerate(siblings) if j != i and type(o.module) is type(m)]
        if any(_series(siblings, i, j) or abs(j - i) == 1 for j in same):
            out.append(i)
    return out


def _layers_with_weights(module: nn.Module) -> int:
    """How many modules in ``module`` (itself included) hold parameters of their own, normalisations aside:
    a conv-norm-act holds one, a residual block or a transformer block several."""
    return sum(
        next(m.parameters(recurse=False), None) is not None and "Norm" not in type(m).__name__
        for m in module.modules()
    )


def _is_stage(module: nn.Module) -> bool:
    """A unit holding a series of two or more blocks of one class (blocks: two or more weighted
    layers each; a series of conv-norm-acts is the inside of a block, not a stage)."""
    siblings = _siblings(module)
    units = _units(siblings, weighted=2)
    return any(type(siblings[i].module) is type(siblings[j].module) and _series(siblings, i, j)
               for k, i in enumerate(units) for j in units[k + 1:])


def _structural_blocks(parent: nn.Module, weighted: int) -> Iterator[nn.Module]:
    """The units below ``parent`` that are no stage, each with ``weighted`` or more weighted layers."""
    siblings = _siblings(parent)
    units = set(_units(siblings, weighted))
    for i, s in enumerate(siblings):
        if i in units and not _is_stage(s.module):
            yield s.module
        else:
            yield from _structural_blocks(s.module, weighted)


def _innermost(found: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The modules of ``found`` (qualified name, module) that hold none of the others."""
    names = [n for n, _ in found]
    return [m for n, m in found if not any(o.startswith(n + ".") for o in names)]


def _lone_blocks(model: nn.Module) -> list[nn.Module]:
    """Blocks (a forward, two or more weighted layers) held alone in a container: a stack of depth
    one, or one layer a loop calls again and again (ALBERT shares one layer across its depth);
    innermost where they nest."""
    modules = dict(model.named_modules())

    def in_a_stack(name: str) -> bool:
        parent = modules[name.rpartition(".")[0]]
        return isinstance(parent, (nn.ModuleList, nn.Sequential)) and _passes_through(parent)

    return _innermost([(n, m) for n, m in modules.items()
                       if n and in_a_stack(n) and has_forward(m) and _layers_with_weights(m) >= 2])


def _marked(model: nn.Module) -> list[nn.Module]:
    """The modules the model's library marks as its checkpointing units, innermost where they nest."""
    return _innermost([(n, m) for n, m in model.named_modules()
                       if n and any(c.__name__ == HF_MARK for c in type(m).__mro__)])


def _outermost(found: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The modules of ``found`` (qualified name, module) held by none of the others."""
    names = [n for n, _ in found]
    return [m for n, m in found if not any(n.startswith(o + ".") for o in names)]


def _diffusers_model(module: nn.Module) -> bool:
    """A diffusers model that can checkpoint itself (``ModelMixin``'s ``_supports_gradient_checkpointing``;
    transformers spells its flag without the underscore)."""
    return getattr(type(module), DIFFUSERS_MARK, False) is True


def _diffusers_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules diffusers' ``enable_gradient_checkpointing()`` runs through its checkpointing function.

    It switches on every module of a diffusers model that has a boolean ``gradient_checkpointing``
    (``ModelMixin._set_gradient_checkpointing``); each such *caller* checkpoints some of its children
    in its forward. Which ones is written only in that forward, so they are read from the structure
    (checked against diffusers 0.42 on UNet2DConditionModel, DiT, PixArt, SD3, Flux and AutoencoderKL:
    ``ckpt_tools/zoo/diffusion.py``): a caller's children (through containers) with a forward and
    two or more weighted layers, of a class found twice or more among all callers' children. A
    model's one-off embedders (PixArt's ``adaln_single`` and ``caption_projection``, SD3's
    ``time_text_embed``) run outside the checkpoints; a nested diffusers model (the
    ``Transformer2DModel`` in a UNet's cross-attention block) checkpoints its own blocks, not being
    checkpointed by its caller. Outermost where they nest: the VAE's Encoder checkpoints its mid
    block whole (the mid block's ``Attention`` runs inside that checkpoint, not one of its own).
    """
    callers: dict[str, nn.Module] = {}
    for root_name, root in model.named_modules():
        if _diffusers_model(root):
            for name, module in root.named_modules(prefix=root_name):
                if isinstance(getattr(module, "gradient_checkpointing", None), bool):
                    callers[name] = module
    if not callers:
        return []
    ids = {id(m): n for n, m in model.named_modules()}
    found: dict[str, nn.Module] = {}
    for caller in callers.values():
        for s in _siblings(caller):
            m = s.module
            if has_forward(m) and not _diffusers_model(m) and _layers_with_weights(m) >= 2:
                found[ids[id(m)]] = m
    counts: dict[type, int] = {}
    for m in found.values():
        counts[type(m)] = counts.get(type(m), 0) + 1
    ordered = [(n, m) for n, m in model.named_modules() if n in found and counts[type(m)] >= 2]
    return _outermost(ordered)


def _timm_callers(model: nn.Module) -> list[nn.Module]:
    """The modules of timm models in ``model`` that checkpoint children of theirs: each has a boolean
    ``grad_checkpointing`` (False until the model's ``set_grad_checkpointing()`` turns it on), below a
    module with ``set_grad_checkpointing()``: the model itself (EfficientNet, ResNet, ViT, MobileNetV3)
    or its stages (RegNet, ConvNeXt, Swin)."""
    callers: dict[str, nn.Module] = {}
    for root_name, root in model.named_modules():
        if callable(getattr(root, TIMM_MARK, None)):
            for name, module in root.named_modules(prefix=root_name):
                if isinstance(getattr(module, "grad_checkpointing", None), bool):
                    callers[name] = module
    return list(callers.values())


def _timm_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules timm's ``set_grad_checkpointing()`` checkpoints, each on its own, outermost where they nest.

    A caller (:func:`_timm_callers`) runs one sequence of its children through ``checkpoint_seq`` (every
    element a checkpoint of its own; timm.models._manipulate) in its forward. Which sequence is written
    only there, so it is read from the structure (checked against timm 1.0.31's EfficientNet, MobileNetV3,
    ResNet, RegNet, ConvNeXt, Swin and ViT by running their switch: ``tests/test_timm.py``): the modules
    with a forward and children of their own that the caller holds in containers, through nested ones
    (EfficientNet's ``checkpoint_seq(self.blocks, x, flatten=True)``: every block of every stage, the
    lone depthwise-separable block of stage 0 too; a ConvNeXt stage's ``blocks``, not the norm and conv
    of its ``downsample``), else its numbered children (a RegNet stage's ``checkpoint_seq(self.children())``
    over ``b1``, ``b2``...). A child held as a plain attribute runs outside: ViT's ``patch_embed`` and
    ``attn_pool``, a Swin stage's ``downsample``. Not read: the ``features_only`` models, which checkpoint
    whole stages (``EfficientNetFeatures``: ``checkpoint(b, x)`` per stage); their blocks are chosen.
    """
    ids = {id(m): n for n, m in model.named_modules()}
    found: set[str] = set()
    for caller in _timm_callers(model):
        parts = [s for s in _siblings(caller) if has_forward(s.module) and next(s.module.children(), None) is not None]
        found.update(ids[id(s.module)] for s in ([s for s in parts if s.stacked] or
                                                 [s for s in parts if s.numbered() is not None]))
    return _outermost([(n, m) for n, m in model.named_modules() if n in found])


def _declared_no_split(model: nn.Module) -> list[str]:
    """The class names Hugging Face models in ``model`` declare in ``_no_split_modules``, in model order."""
    declared: dict[str, None] = {}
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if isinstance(names, (set, frozenset)):
            names = sorted(names)
        if isinstance(names, (list, tuple)):
            declared.update((n, None) for n in names if isinstance(n, str) and n)
    return list(declared)


def _classes(modules: list[nn.Module]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(type(m).__name__ for m in modules))


def find_blocks(model: nn.Module) -> tuple[tuple[str, ...], str] | Problem:
    """The class names of ``model``'s blocks and which rule found them (``"HF GradientCheckpointingLayer"``,
    ``"diffusers gradient_checkpointing"``, ``"timm set_grad_checkpointing"``, ``"repeated blocks"``,
    ``"a block alone in a ModuleList/Sequential"``, ``"repeated layers"``, ``"HF _no_split_modules"``), or the
    Problem saying nothing repeats."""
    marked = _marked(model)
    if marked:
        return _classes(marked), f"HF {HF_MARK}"
    called = _diffusers_blocks(model)
    if called:
        return _classes(called), "diffusers gradient_checkpointing"
    timm = _timm_blocks(model)
    if timm:
        return _classes(timm), f"timm {TIMM_MARK}"
    blocks = list(_structural_blocks(model, weighted=2))
    if blocks:
        return _classes(blocks), "repeated blocks"
    lone = _lone_blocks(model)
    if lone:
        return _classes(lone), "a block alone in a ModuleList/Sequential"
    pieces = list(_structural_blocks(model, weighted=1))
    if pieces:
        return _classes(pieces), "repeated layers"
    counts: dict[str, int] = {}
    for module in model.modules():
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    declared = [c for c in _declared_no_split(model) if counts.get(c, 0) >= 2]
    if declared:
        return tuple(declared), "HF _no_split_modules"
    return Problem(
        "ckpt.layers",
        f"ckpt.layers=auto found no repeated block in {type(model).__name__}: no module subclasses Hugging Face's "
        f"{HF_MARK}, and no two modules of one class (with a forward and submodules) sit side by side or in one "
        "nn.ModuleList, nn.Sequential or nn.ModuleDict",
        "name the layers instead (a class name, a module name or a glob such as 'blocks.*'); class names "
        f"in this model, most instances first: {', '.join(sorted(counts, key=lambda c: (-counts[c], c))[:12])}",
    )


__all__ = ["HF_MARK", "find_blocks", "has_forward"]

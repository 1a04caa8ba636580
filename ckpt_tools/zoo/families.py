"""The zoo's families outside Hugging Face and torch (issue #33): proteins, graphs, einx, torchtune.

    python -m ckpt_tools.zoo esm.esm2 pyg.gcn pyg.gat pyg.graphsage xt.decoder xt.encoder torchtune.llama3

Each entry is built from a tiny config as its library's users build it and
called as their training loop calls it:

- ``protein``: fair-esm's ``ESM2`` (two layers, width 32, the ESM-1b
  alphabet), masked-language-model training on token rows of which one is
  padded, so ``padding_mask`` reaches every layer (ESM2's forward drops it
  when ``padding_mask.any()`` is false: a value read). No checkpointing of its own.
- ``graph``: torch_geometric's ``GCN``, ``GAT`` and ``GraphSAGE``
  (``torch_geometric.nn.models``, three layers, dropout on), node
  classification on a small random graph: ``model(x, edge_index)``. None has
  checkpointing of its own.
- ``einx``: x-transformers' ``TransformerWrapper`` over a ``Decoder`` and an
  ``Encoder`` (dim 32, depth 2, heads 2; its einops/einx rearrangements),
  called with ``mask=`` for a padded row. It has no checkpointing of its own.
- ``torchtune``: ``torchtune.models.llama3.llama3`` (two layers, grouped-query
  attention), its own checkpointing torchtune's recipes' call,
  ``training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})``.

Every loss reads its labels from a seeded generator, so two steps match bit for bit.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_tools.zoo import ZooModel

B, T, V = 2, 16, 64  # batch, tokens, vocabulary (x-transformers, torchtune)
PAD_FROM = 11  # row 1 is padding from here on
NODES, EDGES, FEATURES, CLASSES = 24, 72, 8, 4  # the random graph


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(build):
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build().train()
    return seeded


# ------------------------------------------------------------------------------------------- protein: fair-esm ESM2

def _esm_alphabet():
    import esm

    return esm.Alphabet.from_architecture("ESM-1b")


def _esm_model() -> nn.Module:
    import esm

    return esm.model.esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=2, alphabet=_esm_alphabet())


def _esm_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, both ``(B, T)``: ``<cls>`` amino acids ``<eos>``, row 1 padded; about 15 % of the
    amino acids masked (``<mask>``), their identities the targets (-100 elsewhere), as ESM's MLM training does."""
    alphabet = _esm_alphabet()
    gen = _gen(11)
    amino = [alphabet.get_idx(a) for a in "ACDEFGHIKLMNPQRSTVWY"]
    rows = torch.tensor(amino)[torch.randint(len(amino), (B, T), generator=gen)]
    rows[:, 0] = alphabet.cls_idx
    rows[0, -1] = alphabet.eos_idx
    rows[1, PAD_FROM - 1] = alphabet.eos_idx
    rows[1, PAD_FROM:] = alphabet.padding_idx
    masked = (torch.rand(B, T, generator=gen) < 0.15) & torch.isin(rows, torch.tensor(amino))
    masked[0, 3] = True  # at least one target
    targets = rows.masked_fill(~masked, -100)
    return rows.masked_fill(masked, alphabet.mask_idx), targets


def _esm_batch() -> dict[str, Any]:
    return {"tokens": _esm_rows()[0]}


def _esm_loss(output: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = output["logits"]  # (B, T, vocabulary)
    return F.cross_entropy(logits.flatten(0, 1), _esm_rows()[1].flatten(), ignore_index=-100)


# -------------------------------------------------------------------------------------------- graph: torch_geometric

def _graph_batch() -> dict[str, Any]:
    gen = _gen(12)
    return {"x": torch.randn(NODES, FEATURES, generator=gen),
            "edge_index": torch.randint(NODES, (2, EDGES), generator=gen)}


def _graph_loss(logits: torch.Tensor) -> torch.Tensor:
    labels = torch.randint(CLASSES, (NODES,), generator=_gen(13))  # (N,)
    train = torch.arange(NODES) % 3 != 0  # the nodes with labels, as a dataset's train_mask
    return F.cross_entropy(logits[train], labels[train])


def _pyg(name: str):
    def build() -> nn.Module:
        from torch_geometric.nn import models

        extra = {"heads": 2} if name == "GAT" else {}
        return getattr(models, name)(in_channels=FEATURES, hidden_channels=16, num_layers=3, out_channels=CLASSES,
                                     dropout=0.1, **extra)
    return build


# ------------------------------------------------------------------------------------------- einx: x-transformers

def _xt(stack: str):
    def build() -> nn.Module:
        import x_transformers

        return x_transformers.TransformerWrapper(num_tokens=V, max_seq_len=T, attn_layers=getattr(
            x_transformers, stack)(dim=32, depth=2, heads=2))
    return build


def _token_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, both ``(B, T)``; ``mask`` is True on real tokens, row 1 padded from ``PAD_FROM``."""
    ids = torch.randint(1, V, (B, T), generator=_gen(seed))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, PAD_FROM:] = False
    return ids.masked_fill(~mask, 0), mask


def _xt_batch() -> dict[str, Any]:
    ids, mask = _token_rows(14)
    return {"x": ids, "mask": mask}


def _next_token_loss(logits: torch.Tensor, seed: int) -> torch.Tensor:
    ids, mask = _token_rows(seed)
    labels = ids.masked_fill(~mask, -100)[:, 1:]  # (B, T - 1): the next token, padding ignored
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


# ---------------------------------------------------------------------------------------------- torchtune: Llama 3

def _llama3() -> nn.Module:
    from torchtune.models.llama3 import llama3

    return llama3(vocab_size=V, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, max_seq_len=64)


def _torchtune_own(model: nn.Module) -> None:
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})


def models() -> list[ZooModel]:
    """The entries whose library imports here (each family is skipped alone when its package is missing)."""
    found = {name: importlib.util.find_spec(name) is not None
             for name in ("esm", "torch_geometric", "x_transformers", "torchtune")}
    out: list[ZooModel] = []
    if found["esm"]:
        out.append(ZooModel("esm.esm2", "protein", _seeded(_esm_model), _esm_batch, _esm_loss, None,
                            ("TransformerLayer",)))
    if found["torch_geometric"]:
        out += [ZooModel(f"pyg.{name.lower()}", "graph", _seeded(_pyg(name)), _graph_batch, _graph_loss, None, units)
                for name, units in (("GCN", ("GCNConv",)), ("GAT", ("GATConv",)), ("GraphSAGE", ("SAGEConv",)))]
    if found["x_transformers"]:
        out += [ZooModel(f"xt.{stack.lower()}", "einx", _seeded(_xt(stack)), _xt_batch,
                         lambda logits: _next_token_loss(logits, 14), None, ("Attention", "FeedForward"))
                for stack in ("Decoder", "Encoder")]
    if found["torchtune"]:
        out.append(ZooModel("torchtune.llama3", "torchtune", _seeded(_llama3),
                            lambda: {"tokens": _token_rows(15)[0]}, lambda logits: _next_token_loss(logits, 15),
                            _torchtune_own, ("TransformerSelfAttentionLayer",)))
    return out


__all__ = ["models"]

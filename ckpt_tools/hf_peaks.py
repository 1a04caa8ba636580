"""The activation peak of a Hugging Face training step: no checkpointing, HF's own, the plugin's.

    python -m ckpt_tools.hf_peaks

Tiny GPT-2, Llama and T5 built from configs (nothing is downloaded), called as
their users call them in training: ``model(input_ids=..., attention_mask=...,
labels=...)`` with the configs' default ``use_cache=True``. Each step is measured
by ``MemTracker`` (``ckpt_plugin.measure.memory.step_memory``: exact bytes on CPU)
after one warm-up step, for the model without checkpointing, with
``gradient_checkpointing_enable()`` and with ``apply_checkpointing(model,
layers="auto")``. Prints the activation and total peaks and ours over HF's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ckpt_plugin import apply_checkpointing
from ckpt_plugin.measure.memory import step_memory

B, T, V = 2, 16, 64  # batch, sequence, vocabulary


def models() -> dict[str, Callable[[], nn.Module]]:
    import transformers as hf

    return {
        "GPT-2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
        "Llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)),
        "T5": lambda: hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0)),
    }


def batch(padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 12:] = 0  # row 1 padded after 12 tokens, as a tokenizer pads for training
    return dict(input_ids=ids, attention_mask=mask, labels=ids) if padded else dict(input_ids=ids, labels=ids)


def peaks(make: Callable[[], nn.Module], kwargs: dict) -> dict[str, dict[str, int]]:
    """``{"none"|"hf"|"ours": {"act": bytes, "total": bytes}}`` of one training step each."""
    found = {}
    for how in ("none", "hf", "ours"):
        torch.manual_seed(0)
        model = make().train()
        if how == "hf":
            model.gradient_checkpointing_enable()
        elif how == "ours":
            apply_checkpointing(model, layers="auto")

        def step(model: nn.Module = model) -> None:
            model(**kwargs).loss.backward()

        step()  # warm-up: lazily built buffers (rotary tables, masks) are not the step's
        model.zero_grad(set_to_none=True)
        memory = step_memory(step, model)
        found[how] = {"act": memory["act"], "total": memory["total"]}
    return found


def main() -> None:
    warnings.simplefilter("ignore")  # HF's and ours ("use_cache=False"): said once, known here
    print("python -m ckpt_tools.hf_peaks  (bytes; MemTracker, one training step, CPU)")
    print(f"{'model':<18}{'none act':>10}{'HF act':>10}{'ours act':>10}{'ours/HF':>9}{'HF total':>10}{'ours total':>11}")
    for name, make in models().items():
        for padded in ((True, False) if name != "T5" else (False,)):
            p = peaks(make, batch(padded))
            label = f"{name}{' padded' if padded else ''}"
            print(f"{label:<18}{p['none']['act']:>10,}{p['hf']['act']:>10,}{p['ours']['act']:>10,}"
                  f"{p['ours']['act'] / p['hf']['act']:>9.3f}{p['hf']['total']:>10,}{p['ours']['total']:>11,}")


if __name__ == "__main__":
    main()

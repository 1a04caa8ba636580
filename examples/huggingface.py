"""Checkpoint a Hugging Face model's decoder layers in a plain PyTorch training step.

    python examples/huggingface.py

A tiny GPT-2 built from its config (nothing is downloaded), called the way its
users call it. Its config says ``use_cache=True``, so every training call hands
the layers a KV cache: the checkpointed layers run with it off, as Hugging
Face's own gradient checkpointing does, and one warning says so.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ckpt_plugin import apply_checkpointing, saved_activations

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)).train()
input_ids = torch.randint(1, 64, (2, 16))  # (B, T)
attention_mask = torch.ones_like(input_ids)
attention_mask[1, 12:] = 0  # the second row is padded after 12 tokens
labels = input_ids.masked_fill(attention_mask == 0, -100)  # no loss on padding
batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

before = saved_activations(model, **batch).total_bytes  # a forward on fake tensors: nothing allocated
print("checkpointed:", apply_checkpointing(model, layers="GPT2Block"))  # <-- LlamaDecoderLayer, T5Block, ...
after = saved_activations(model, **batch).total_bytes
print(f"saved for backward: {before} bytes without checkpointing, {after} with")

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(**batch).loss  # each GPT2Block runs again in backward, its KV cache off
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")

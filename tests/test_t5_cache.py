"""T5 trained with its config's default ``use_cache=True`` (issue #33, item 6): what is bitwise, and what no
checkpointing that drops the cache can be.

The plain step with the cache on hands every attention of the decoder the cache's copies of its keys and
values (transformers' ``DynamicLayer.update`` returns ``torch.cat([empty, keys])``: contiguous); a step
without a cache hands it the projections' transposed views. The values are the same, so the loss is too,
but the attention's batched matmul then gets its key operand in the other layout, and MKL's GEMM rounds by
layout (its kernels differ for transposed and plain operands: pytorch#104439, pytorch#148939): on an AVX-512
EPYC the gradient of ``shared.weight`` differs in 794 of its 4,096 elements, by up to 7.5e-9, and every
other gradient upstream of the decoder's attention too (the encoder's through the cross-attention). It is
neither the plugin nor the order in which the tied ``shared.weight`` sums its three uses: the encoder's
first query projection, used once, differs as well.

So every step that drops the cache (the same call with ``use_cache=False``, Hugging Face's
``activation_checkpointing_enable()``, ours with ``layers="auto"`` or ``"T5Block"``) is bitwise every other
one, and all differ from the cached step by the same bits. With MKL's one layout-blind code path
(``MKL_CBWR=COMPATIBLE``, a fresh process: MKL reads it when it loads) the cached step is bitwise them all.
To give the cached step's bits on any CPU, a checkpointed layer would have to fill a throwaway cache in its
forward and again in its recomputation: a computation other than Hugging Face's checkpointing, whose bits
it would then no longer give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt_plugin  # its names load when first used: the MKL test's process loads none

B, T, V = 2, 16, 128  # batch, tokens, vocabulary: shared.weight is (128, 32), 4,096 elements
IDS = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
WRAPPED = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]


def t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)  # dropout 0.1, use_cache=True
    return transformers.T5ForConditionalGeneration(config).train()


def step(model: nn.Module, **extra) -> tuple[torch.Tensor, dict[str, torch.Tensor], int | None]:
    """Loss, every gradient by name, and the length of the returned cache (None: no cache) of one step."""
    torch.manual_seed(5)  # the same dropout masks in every run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ours and HF's "use_cache=False" notes: tests/test_hf.py reads them
        out = model(input_ids=IDS, labels=IDS, **extra)
        out.loss.backward()
    cache = None if out.past_key_values is None else out.past_key_values.get_seq_length()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, cache


def steps() -> dict[str, tuple]:
    """The cached plain step and the four that drop the cache."""
    hf_own, auto, full = t5(), t5(), t5()
    hf_own.activation_checkpointing_enable()
    assert ckpt_plugin.apply_checkpointing(auto, layers="auto") == WRAPPED
    assert ckpt_plugin.apply_checkpointing(full, layers="T5Block") == WRAPPED
    return {"cached": step(t5()), "uncached": step(t5(), use_cache=False), "hf_own": step(hf_own),
            "ours auto": step(auto), "ours T5Block": step(full)}


def test_every_step_without_the_cache_is_bitwise_the_same_and_differs_from_the_cached_one_alike() -> None:
    runs = steps()
    loss, cached, length = runs.pop("cached")
    assert length == T  # the plain step filled its cache; the others return none, as HF's checkpointing does
    want = runs["uncached"][1]
    for name, (other_loss, grads, other_length) in runs.items():
        assert torch.equal(other_loss, loss), name
        assert other_length is None, name
        assert grads.keys() == cached.keys() == want.keys(), name
        assert all(torch.equal(grads[k], want[k]) for k in want), name  # shared.weight included
        # Against the cached step: the same gradients differ, by the same bits, as for use_cache=False.
        assert all(torch.equal(cached[k] - grads[k], cached[k] - want[k]) for k in want), name
        assert max((cached[k] - grads[k]).abs().max().item() for k in want) <= 1e-7, name


SCRIPT = """
import json, sys
import torch
sys.path.insert(0, "tests")
from test_t5_cache import step, t5
(loss, cached, _), (other, grads, _) = step(t5()), step(t5(), use_cache=False)
differing = [k for k in cached if not torch.equal(grads[k], cached[k])]
print(json.dumps(([] if torch.equal(other, loss) else ["loss"]) + differing))
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL_CBWR is MKL's setting")
def test_with_mkl_layout_blind_the_cached_step_is_bitwise_the_uncached_one() -> None:
    """The difference is the GEMM's rounding of the cache's copies, nothing a step without the cache does:
    with MKL's one code path for every layout the cached step is bitwise the uncached one, and so (the test
    above, on any BLAS) HF's own checkpointing and ours."""
    # Read when MKL loads, so a process of its own; one thread, as the suite's workers run (conftest.py).
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []  # the loss and all 47 gradients

"""Hugging Face models, called as their users call them (issue #14), and arguments a replay must not change.

A training call ``model(input_ids=..., attention_mask=..., labels=...)`` hands every
decoder layer a KV cache (configs default to ``use_cache=True``). Wrapped, the
layers run with the cache neutralised as transformers' own checkpointing does:
loss and gradients equal a run without checkpointing and one with
``activation_checkpointing_enable()``, the cache comes back empty, never doubled,
one warning says so, and the activation peak (MemTracker, exact on CPU) is HF's
own. In eval and under no_grad the cache is kept and filled once. Then the
general rule: a checkpointed forward that changes a mutable argument raises at once.

Tiny configs built in code; nothing is downloaded.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ckpt_plugin import apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin.engine.plan import EachLayer, WrapPlan
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.measure.memory import step_memory

B, T, V = 2, 16, 64  # batch, sequence, vocabulary


def hf():
    return pytest.importorskip("transformers")


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = hf().GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32)  # dropout 0.1
    return hf().GPT2LMHeadModel(config).train()


def llama(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    config = hf().LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return hf().LlamaForCausalLM(config).train()


def t5(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = hf().T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                           num_heads=4, decoder_start_token_id=0, pad_token_id=0)  # dropout 0.1
    return hf().T5ForConditionalGeneration(config).train()


IDS = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
RIGHT_PADDED = torch.ones(B, T, dtype=torch.long)
RIGHT_PADDED[1, 12:] = 0  # row 1 padded after its 12 tokens, as a tokenizer pads for training
LEFT_PADDED = torch.ones(B, T, dtype=torch.long)
LEFT_PADDED[1, :4] = 0  # row 1 padded before its 12 tokens, as for generation

# name -> (model, layer class, keyword arguments of the training call)
CASES: dict[str, tuple[Callable[[], nn.Module], str, dict]] = {
    "gpt2 padded": (gpt2, "GPT2Block", dict(input_ids=IDS, attention_mask=RIGHT_PADDED, labels=IDS)),
    "llama left-padded": (llama, "LlamaDecoderLayer", dict(input_ids=IDS, attention_mask=LEFT_PADDED, labels=IDS)),
    "llama without mask": (llama, "LlamaDecoderLayer", dict(input_ids=IDS, labels=IDS)),
    "t5": (t5, "T5Block", dict(input_ids=IDS, labels=IDS)),
}


def cache_warning(layer: str, changes: str) -> str:
    return (f"ckpt_plugin: {layer} is checkpointed in training, so its KV cache is not filled ({changes}), as "
            f"Hugging Face's own gradient checkpointing does: the recomputation in backward would fill it a "
            f"second time.")


def model_warning(model: str) -> str:
    return (f"ckpt_plugin: {model} has checkpointed layers and is training, so it runs with use_cache=False and "
            f"returns no KV cache, as with Hugging Face's own gradient checkpointing: the recomputation in "
            f"backward would fill the cache a second time.")


def positional_name(layer: nn.Module, position: int) -> str:
    """What ``layer.forward`` calls its positional parameter ``position``: transformers renames
    GPT2Block's cache parameter between releases (``layer_past``, ``past_key_values``, ``cache``)."""
    params = [p for p in inspect.signature(type(layer).forward).parameters.values()  # the class's: unwrapped
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return params[1 + position].name  # after self


def train_step(model: nn.Module, kwargs: dict, seed: int = 5):
    """Loss, every parameter's gradient by name, the returned cache, and our warnings, of one step."""
    torch.manual_seed(seed)  # the same dropout masks in every run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**kwargs)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ours = [str(w.message) for w in caught if str(w.message).startswith("ckpt_plugin")]
    return out.loss.detach(), grads, out.past_key_values, ours


def seq_length(cache) -> int | None:
    return None if cache is None else cache.get_seq_length()


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ----------------------------------------------------------------------------- the training call


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_call_equals_no_checkpointing_and_hf_own(case: str) -> None:
    make, layer, kwargs = CASES[case]
    plain, uncached, theirs, ours = make(), make(), make(), make()
    theirs.activation_checkpointing_enable()
    names = apply_checkpointing(ours, layers=layer)
    assert names and all(type(ours.get_submodule(n)).__name__ == layer for n in names)

    loss, grads, cache, _ = train_step(plain, kwargs)
    same_loss, same_grads, _, _ = train_step(uncached, kwargs | {"use_cache": False})
    hf_loss, hf_grads, hf_cache, _ = train_step(theirs, kwargs)
    our_loss, our_grads, our_cache, warned = train_step(ours, kwargs)
    again = train_step(ours, kwargs)

    assert warned == [model_warning(type(ours).__name__)]
    assert again[3] == []  # one warning per installation, not per step
    for want in (loss, same_loss, hf_loss):
        assert torch.equal(our_loss, want) and torch.equal(again[0], want)
    # Bit for bit what the same call computes without checkpointing and without a cache, and
    # what HF's own checkpointing computes (dropout on: the recomputation replays its masks).
    assert our_grads.keys() == same_grads.keys() == hf_grads.keys() == grads.keys()
    assert all(torch.equal(our_grads[k], same_grads[k]) and torch.equal(our_grads[k], hf_grads[k]) for k in grads)
    assert all(torch.equal(again[1][k], same_grads[k]) for k in grads)
    # The plain call that fills its cache differs in the last bits for GPT-2 and T5, as HF's own
    # checkpointing does: the cache's update hands attention torch.cat copies of the keys and
    # values (contiguous), whose matmul backward rounds differently from the strided views.
    assert max_difference(our_grads, grads) <= 1e-7
    # Without checkpointing the cache holds the 16 tokens; HF's checkpointing turns the cache
    # off for the whole model and returns None, and so does ours.
    assert seq_length(cache) == T
    assert hf_cache is None and our_cache is None and again[2] is None


def test_each_installation_warns_once() -> None:
    make, layer, kwargs = CASES["gpt2 padded"]
    model = make()
    apply_checkpointing(model, layers=layer)
    assert train_step(model, kwargs)[3] == [model_warning("GPT2LMHeadModel")]
    apply_checkpointing(model, layers=layer)  # a second fit installs again
    assert train_step(model, kwargs)[3] == [model_warning("GPT2LMHeadModel")]


@pytest.mark.parametrize("case", ["gpt2 padded", "llama left-padded"])
def test_in_eval_the_cache_is_kept_and_filled_once(case: str) -> None:
    make, layer, kwargs = CASES[case]
    kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    plain, ours = make().eval(), make().eval()
    apply_checkpointing(ours, layers=layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning of ours
        with torch.no_grad():  # generation-like
            want, got = plain(**kwargs), ours(**kwargs)
        assert torch.equal(got.logits, want.logits)
        assert seq_length(got.past_key_values) == seq_length(want.past_key_values) == T
        # Eval without no_grad (an evaluation loop that forgot it, or input gradients):
        # HF does not checkpoint in eval, so neither do we where a cache is given.
        want, got = plain(**kwargs), ours(**kwargs)
        assert seq_length(got.past_key_values) == seq_length(want.past_key_values) == T
        want.logits.sum().backward()
        got.logits.sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ours.parameters(), strict=True))
        generate = dict(attention_mask=kwargs["attention_mask"], max_new_tokens=4, do_sample=False)
        assert torch.equal(ours.generate(IDS, **generate), plain.generate(IDS, **generate))


@pytest.mark.parametrize("case", ["gpt2 padded", "llama left-padded", "t5"])
def test_the_activation_peak_is_hf_own(case: str) -> None:
    """MemTracker's activation peak of one step (exact and deterministic on CPU).

    Measured (bytes): GPT-2 127112 ours, 127112 HF's (277912 without checkpointing);
    Llama 82312, 82312 (191640); T5 132872, 142600 (351752).
    """
    make, layer, kwargs = CASES[case]
    theirs, ours = make(), make()
    theirs.activation_checkpointing_enable()
    apply_checkpointing(ours, layers=layer)
    peaks = {}
    for name, model in (("hf", theirs), ("ours", ours)):
        def step(model: nn.Module = model) -> None:
            model(**kwargs).loss.backward()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peaks[name] = step_memory(step, model)
    assert peaks["ours"]["act"] <= 1.01 * peaks["hf"]["act"], peaks
    assert peaks["ours"]["total"] <= 1.01 * peaks["hf"]["total"], peaks


def test_another_checkpoint_implementation_gets_the_neutralised_arguments() -> None:
    """``ckpt.deepspeed`` swaps in DeepSpeed's checkpoint (``Treatment.checkpoint_fn``); a stand-in records."""
    seen = []

    def checkpoint_fn(fn, _stats, *args, **kwargs):
        seen.append((args, kwargs))
        return torch.utils.checkpoint.checkpoint(functools.partial(fn, **kwargs), *args, use_reentrant=False)

    make, layer, kwargs = CASES["gpt2 padded"]
    plain, ours = make(), make()
    names = ("transformer.h.0", "transformer.h.1")
    install(ours, WrapPlan((EachLayer(names, Treatment(checkpoint_fn=checkpoint_fn)),)))
    loss, grads, _, _ = train_step(plain, kwargs | {"use_cache": False})
    # A cache given with use_cache=False reaches the layers (GPT-2 passes it positionally): theirs is cleared.
    given = hf().DynamicCache()
    our_loss, our_grads, _, warned = train_step(ours, kwargs | {"use_cache": False, "past_key_values": given})
    assert len(seen) == 2 and all(args[1] is None and kw["use_cache"] is False for args, kw in seen)
    cache_parameter = positional_name(ours.get_submodule(names[0]), 1)  # GPT2Model passes the cache second
    assert warned == [cache_warning(layer, f"{cache_parameter}=None")] and seq_length(given) == 0
    assert torch.equal(our_loss, loss) and all(torch.equal(our_grads[k], grads[k]) for k in grads)


# ----------------------------------------------------------------------------- ckpt=auto on a language model


def test_auto_plans_a_decoder_lm_called_with_its_default_cache() -> None:
    """``ckpt=auto`` times each candidate again and again on the sample call, in which a decoder LM
    (``use_cache=True`` by default) hands every layer its KV cache: the timing runs get none, as a
    checkpointed training call does, so the cache cannot grow between them (issue #20: a crash)."""
    plain, ours = llama(), llama()
    kwargs = CASES["llama left-padded"][2]
    ours.example_input_array = kwargs  # as a Lightning user sets it: the training call's keywords
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = apply_checkpointing(ours, layers="auto", mode="auto", budget=0.5)
    layers = [n for n, m in ours.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]
    # The decoder layers, or parts of them (ckpt=auto may checkpoint inside a layer: planning/inside.py).
    assert names and all(any(n == x or n.startswith(x + ".") for x in layers) for n in names), names
    assert [str(w.message) for w in caught if str(w.message).startswith("ckpt_plugin")] == []  # planning is silent
    loss, grads, _, _ = train_step(plain, kwargs)
    our_loss, our_grads, our_cache, warned = train_step(ours, kwargs)
    assert warned == [model_warning("LlamaForCausalLM")] and our_cache is None
    assert torch.equal(our_loss, loss) and all(torch.equal(our_grads[k], grads[k]) for k in grads)


# ----------------------------------------------------------------------------- segments over a Llama


@pytest.mark.parametrize("segments", [2, "recursive"])
def test_segments_over_llama_decoder_layers(segments) -> None:
    """LlamaDecoderLayer takes the mask and position embeddings as keyword arguments, the same for every layer."""
    plain, ours = llama(layers=4), llama(layers=4)
    kwargs = CASES["llama left-padded"][2]
    assert apply_checkpointing(ours, layers="LlamaDecoderLayer", segments=segments) == [
        f"model.layers.{i}" for i in range(4)]
    loss, grads, cache, _ = train_step(plain, kwargs)  # a Llama's cache changes no bit of its gradients
    our_loss, our_grads, our_cache, warned = train_step(ours, kwargs)
    assert warned == [model_warning("LlamaForCausalLM")]
    assert torch.equal(our_loss, loss)
    assert all(torch.equal(our_grads[k], grads[k]) for k in grads)
    assert our_cache is None and seq_length(cache) == T
    ours.eval()  # eval with grad enabled: the pass runs without regions, the cache fills once
    assert seq_length(ours(input_ids=IDS, attention_mask=LEFT_PADDED).past_key_values) == T


def test_segments_over_gpt2_blocks_that_take_their_cache_positionally() -> None:
    """Every GPT2Block gets the same mask and cache positionally, after the hidden states."""
    plain, ours = gpt2(), gpt2()
    kwargs = CASES["gpt2 padded"][2]
    apply_checkpointing(ours, layers="GPT2Block", segments=1)
    loss, grads, _, _ = train_step(plain, kwargs | {"use_cache": False})
    given = hf().DynamicCache()  # given with use_cache=False: the model passes it on, the chain clears it
    our_loss, our_grads, _, warned = train_step(ours, kwargs | {"use_cache": False, "past_key_values": given})
    cache_parameter = positional_name(ours.transformer.h[0], 1)  # GPT2Model passes the cache second
    assert warned == [cache_warning("GPT2Block", f"{cache_parameter}=None")] and seq_length(given) == 0
    assert torch.equal(our_loss, loss) and all(torch.equal(our_grads[k], grads[k]) for k in grads)


# ----------------------------------------------------------------------------- mutable arguments


class Block(nn.Module):
    """A layer with a side argument; ``write`` says what its forward does to it."""

    def __init__(self, write: str | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.write = write

    def forward(self, x: torch.Tensor, log: list | None = None, state: dict | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x)) * state["scale"] if state is not None else torch.tanh(self.fc(x))
        if self.write == "dict":
            state["calls"] = state.get("calls", 0) + 1
        elif self.write == "list":
            log.append(y.shape)
        elif self.write == "tensor in dict":
            state["scale"].mul_(1.0)
        elif self.write == "object":
            state["holder"].count += 1
        return y


class Net(nn.Module):
    def __init__(self, write: str | None = None, positional: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(write), Block()])
        self.positional = positional

    def forward(self, x: torch.Tensor, log: list, state: dict) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, log, state=state) if self.positional else block(x, log=log, state=state)
        return x.sum()


class Holder:
    def __init__(self) -> None:
        self.count = 0


def mutation(where: str, kind: str) -> str:
    return re.escape(
        f"blocks.0 (Block) changed its argument '{where}' ({kind}) during its forward; the recomputation in "
        f"backward would change it a second time. Make the forward leave it unchanged, pass it outside the "
        f"checkpointed layer, or leave this layer out of ckpt.layers.")


def side_arguments() -> tuple[list, dict]:
    return [], {"scale": torch.tensor(0.5), "holder": Holder()}


@pytest.mark.parametrize("segments", [None, 2])
@pytest.mark.parametrize(("write", "positional", "where", "kind"), [
    ("dict", False, "state", "dict"),
    ("list", False, "log", "list"),
    ("list", True, "log", "list"),  # named from the forward's signature
    ("tensor in dict", False, "state", "dict"),
    ("object", False, "state", "dict"),
])
def test_a_forward_that_changes_an_argument_raises_before_backward(segments, write, positional, where, kind) -> None:
    torch.manual_seed(0)
    model = Net(write, positional)
    apply_checkpointing(model, layers="Block", segments=segments)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="^" + mutation(where, kind) + "$"):
        model(x, *side_arguments())
    with torch.no_grad():  # nothing is recomputed: the forward may write
        model(x, *side_arguments())


def test_an_argument_left_unchanged_trains_exactly() -> None:
    torch.manual_seed(0)
    plain = Net()
    ours = Net()
    ours.load_state_dict(plain.state_dict())
    apply_checkpointing(ours, layers="Block")
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in (plain, ours):
            model(x, *side_arguments()).backward()
    assert wrapped_modules(ours) == ["blocks.0", "blocks.1"]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ours.parameters(), strict=True))
    remove_checkpointing(ours)
    assert wrapped_modules(ours) == []

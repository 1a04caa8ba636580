"""Memory and recompute, measured exactly as DESIGN.md says (MemTracker peaks, FlopCounterMode FLOPs)."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt_batch, small_gpt
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin import apply_checkpointing
from ckpt_plugin.measure.memory import REST, saved_bytes, step_flops, step_memory

N_LAYER = 6


@pytest.fixture(scope="module")
def measured() -> dict:
    """One GPT of N_LAYER blocks, measured plain and with every block checkpointed."""
    model = small_gpt(n_layer=N_LAYER, n_embd=64, block_size=64)
    batch = gpt_batch(model, batch=4)
    blocks = [f"blocks.{i}" for i in range(N_LAYER)]

    def step() -> None:
        model.loss(batch).backward()
        model.zero_grad(set_to_none=True)

    def forward() -> torch.Tensor:
        return model.loss(batch)

    out = {"blocks": blocks}
    with FlopCounterMode(display=False) as counter:
        forward()
    out["block_fwd_flops"] = [sum(counter.get_flop_counts()[f"GPT.{n}"].values()) for n in blocks]
    out["plain_saved"] = saved_bytes(model, forward, blocks)
    out["plain_mem"] = step_memory(step, model)
    out["plain_flops"] = step_flops(step)
    assert apply_checkpointing(model, layers="TransformerBlock") == blocks
    out["ckpt_saved"] = saved_bytes(model, forward, blocks)
    out["ckpt_mem"] = step_memory(step, model)
    out["ckpt_flops"] = step_flops(step)
    return out


def test_each_checkpointed_block_keeps_only_its_input(measured: dict) -> None:
    batch, T, C = 4, 64, 64
    block_input = batch * T * C * 4  # one float32 (B, T, C) tensor
    for name in measured["blocks"]:
        assert measured["ckpt_saved"].by_owner[name] == block_input
        assert measured["plain_saved"].by_owner[name] > 10 * block_input
    # What lies outside the blocks is saved the same way with and without.
    assert measured["ckpt_saved"].by_owner[REST] == measured["plain_saved"].by_owner[REST]


def test_activation_peak_is_inputs_plus_outside_plus_one_block(measured: dict) -> None:
    plain, ckpt = measured["plain_saved"], measured["ckpt_saved"]
    inputs = sum(ckpt.by_owner[n] for n in measured["blocks"])
    outside = plain.by_owner[REST]
    one_block = max(plain.by_owner[n] for n in measured["blocks"])
    act_peak = measured["ckpt_mem"]["act"]
    assert act_peak <= inputs + outside + one_block
    # And the plain run really holds every block's activations at once.
    assert measured["plain_mem"]["act"] >= plain.total
    assert act_peak < measured["plain_mem"]["act"] / 3


def test_recompute_costs_at_most_one_forward_of_the_wrapped_blocks(measured: dict) -> None:
    extra = measured["ckpt_flops"] - measured["plain_flops"]
    assert 0 < extra <= sum(measured["block_fwd_flops"])


def test_parameters_and_gradients_are_not_affected(measured: dict) -> None:
    for key in ("param", "grad"):
        assert measured["ckpt_mem"][key] == measured["plain_mem"][key]


def test_a_region_without_tensor_inputs_keeps_nothing_for_anyone() -> None:
    """A non-reentrant region over parameters only keeps no activation, on every torch: torch 2.11 saves a
    0-byte placeholder as its input (``_compat.checkpoint_placeholder``), which is no one's."""
    model = torch.nn.Linear(4, 4)
    run = lambda: torch.utils.checkpoint.checkpoint(lambda: model.weight.sin().sum(), use_reentrant=False)  # noqa: E731
    assert saved_bytes(model, run, []).by_owner == {}

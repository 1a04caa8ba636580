"""Recomputation that survives libraries that re-wrap exceptions (issue #33).

torch's non-reentrant checkpoint stops a recomputation early by raising its private
``_StopRecomputationError`` inside the recomputed forward and catching it around the call
(``torch/utils/checkpoint.py``). einx catches every exception and raises its own, so
x-transformers' ``Attention`` called with ``mask=`` crashed in backward under every mode. Every
checkpoint call of the plugin now finds torch's error in the chain and raises it again
(``ckpt_plugin/_compat/checkpoint.py``). Each test compares the loss and every gradient bitwise
with the step without checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from ckpt_plugin import apply_checkpointing, checkpoint, checkpoint_scan, checkpoint_sequential
from ckpt_plugin._compat import stop_recomputation_error
from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config

try:
    import einx
    import x_transformers
except ImportError:  # the test extra installs both; the GPU check's machines have neither
    einx = x_transformers = None
# Only the x-transformers tests need them: the rest (a library of our own) run wherever torch does.
needs_x_transformers = pytest.mark.skipif(x_transformers is None, reason="x-transformers and einx are not installed")

STOP = stop_recomputation_error()


def _step(model: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step's loss and every parameter's gradient (cleared first)."""
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(got: tuple, expected: tuple) -> None:
    (loss, grads), (loss0, grads0) = got, expected
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys() and grads0
    for name in grads0:
        assert torch.equal(grads[name], grads0[name]), name


def _chain(error: BaseException | None) -> list[type]:
    kinds = []
    while error is not None:
        kinds.append(type(error))
        error = error.__cause__ or error.__context__
    return kinds


# -- x-transformers' Encoder called with mask= (its einx.where re-wraps torch's error) ---------------------------------


def _encoder() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = x_transformers.Encoder(dim=32, depth=2, heads=2)
    x = torch.randn(2, 5, 32)  # (B, T, C)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])  # (B, T): the second sequence is padded
    return model, lambda: model(x, mask=mask).square().mean()


@needs_x_transformers
def test_torch_checkpoint_alone_fails_on_the_encoder_with_a_mask() -> None:
    """The upstream behaviour the plugin works around: einx's error carries torch's as its cause."""
    model, _ = _encoder()
    attention = model.layers[0][1]
    x, mask = torch.randn(2, 5, 32), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    out = torch.utils.checkpoint.checkpoint(lambda h: attention(h, mask=mask), x, use_reentrant=False)
    with pytest.raises(einx.errors.CallOperationError) as raised:
        out.sum().backward()
    assert STOP in _chain(raised.value)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # what trains it without the plugin
        torch.utils.checkpoint.checkpoint(lambda h: attention(h, mask=mask), x, use_reentrant=False).sum().backward()


@needs_x_transformers
@pytest.mark.parametrize("keys", [
    {"layers": "auto"},
    {"layers": "Attention"},
    {"mode": "selective", "layers": "auto", "policy": "matmuls"},
], ids=["full-auto-layers", "full-Attention", "selective-matmuls"])
def test_the_encoder_with_a_mask_trains_bitwise_equal(keys: dict) -> None:
    model, run = _encoder()
    expected = _step(model, run)
    names = apply_checkpointing(model, **keys)
    assert "layers.0.1" in names  # an Attention, the layer that calls einx.where on the mask
    _assert_bitwise(_step(model, run), expected)


@needs_x_transformers
def test_the_encoder_with_a_mask_trains_bitwise_equal_under_auto() -> None:
    model, run = _encoder()
    expected = _step(model, run)
    names = apply_config(model, make_config(mode="auto", layers="auto", budget=0.7), run)
    assert "layers.0.1" in names
    _assert_bitwise(_step(model, run), expected)


# -- a tiny library of our own that re-wraps exceptions --------------------------------------------------------------


class LibraryError(RuntimeError):
    pass


class Rewrapping(nn.Module):
    """A layer whose library raises its own error for any other, as einx does; ``how`` is how."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B, 8)
        failed = None
        try:
            return self.inner(x).sin()  # sin saves its input: early stop fires inside the library's call
        except Exception as err:
            if self.how == "from":
                raise LibraryError(f"library call failed: {err!r}") from err
            if self.how == "from None":
                raise LibraryError(f"library call failed: {err!r}") from None
            failed = repr(err)
        raise LibraryError(f"library call failed: {failed}")  # "dropped": outside the handler, no chain at all


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Rewrapping(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _net(how: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = Net(how)
    x = torch.randn(4, 8)
    return model, lambda: model(x)


@pytest.mark.parametrize("how", ["from", "from None"])
@pytest.mark.parametrize("keys", [
    {"layers": "Rewrapping"},
    {"mode": "selective", "layers": "Rewrapping", "policy": "matmuls"},
    {"layers": "Rewrapping", "segments": 2},
    {"layers": "Rewrapping", "offload": True},
], ids=["full", "selective", "segments", "offload"])
def test_every_mode_trains_a_library_that_rewraps(how: str, keys: dict) -> None:
    model, run = _net(how)
    expected = _step(model, run)
    apply_checkpointing(model, **keys)
    _assert_bitwise(_step(model, run), expected)


@pytest.mark.parametrize("how", ["from", "from None"])
def test_the_functions_train_a_library_that_rewraps(how: str) -> None:
    model, _ = _net(how)
    x = torch.randn(4, 8)
    blocks = list(model.blocks)

    def chain(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = block(h)
        return h.square().mean()

    expected = _step(model, lambda: chain(x))
    _assert_bitwise(_step(model, lambda: checkpoint(chain)(x)), expected)
    _assert_bitwise(_step(model, lambda: checkpoint(chain, policy="matmuls")(x)), expected)
    _assert_bitwise(_step(model, lambda: checkpoint_sequential(blocks, "recursive", x).square().mean()), expected)


def _loop(cell: nn.Module, h: torch.Tensor, n_steps: int) -> torch.Tensor:
    carries = []
    for _ in range(n_steps):
        h = cell(h)
        carries.append(h)
    return torch.stack(carries)  # (n_steps, B, 8)


@pytest.mark.parametrize("how", ["from", "from None"])
def test_checkpoint_scan_trains_a_library_that_rewraps(how: str) -> None:
    model, _ = _net(how)
    cell, x = model.blocks[0], torch.randn(4, 8)
    expected = _step(model, lambda: _loop(cell, x, 4).square().sum())
    _assert_bitwise(_step(model, lambda: checkpoint_scan(cell, x, 4, save_every_n=2).square().sum()), expected)


def test_a_library_that_drops_torchs_error_is_told_what_trains_it() -> None:
    """Nothing left to find: the error says it came from a recomputation and how early stop off trains it."""
    model, run = _net("dropped")
    expected = _step(model, run)
    apply_checkpointing(model, layers="Rewrapping")
    with pytest.raises(LibraryError, match=r"library call failed: _StopRecomputationError\(\)") as raised:
        _step(model, run)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "ckpt_plugin: raised while recomputing Rewrapping.forward for backward" in notes
    assert "set_checkpoint_early_stop(False)" in notes
    model.zero_grad(set_to_none=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        loss = run()
    loss.backward()
    _assert_bitwise((loss.detach(), {n: p.grad for n, p in model.named_parameters()}), expected)


def test_a_forward_that_fails_gets_no_note() -> None:
    """Only a recomputation's error is annotated: the forward's own error is the user's, as it is."""
    model, run = _net("dropped")
    apply_checkpointing(model, layers="Rewrapping")
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as raised:
        model(torch.randn(4, 7))
    assert not getattr(raised.value, "__notes__", [])


def test_a_torch_without_the_name_turns_early_stop_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a torch release moved ``_StopRecomputationError``, the plugin's calls recompute the whole
    forward (torch only raises it with early stop on), so even a library that drops it trains."""
    model, run = _net("dropped")
    expected = _step(model, run)
    apply_checkpointing(model, layers="Rewrapping")
    monkeypatch.delattr(torch.utils.checkpoint, "_StopRecomputationError")
    assert stop_recomputation_error() is None
    _assert_bitwise(_step(model, run), expected)

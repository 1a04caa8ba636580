"""checkpoint_scan: Theano's scan_checkpoints tests, ported, plus the exact memory claim.

As in Theano's ``test_scan_checkpoints``: the forward and the gradients equal
those of a plain loop (here bit for bit), memory is lower, bad arguments are
rejected. Memory and recompute are measured as DESIGN.md says (saved-tensor
hooks, MemTracker peaks, FlopCounterMode), in units of one carry.
"""

from __future__ import annotations

import math

import pytest
import torch

from ckpt_plugin._compat import CategoryPeakTracker
from ckpt_plugin.measure.memory import saved_bytes, step_flops, step_memory
from ckpt_plugin.engine.scan.scan import checkpoint_scan
from scan_cells import BATCH, DIM, Cell, dropout_step, make_init, step

N_STEPS, EVERY = 1024, 32  # the numbers: k=1024 steps, a checkpoint every 32

# (n_steps, save_every_n): divisible, Theano's own k=101 / N=100, a short last
# window, every carry kept, one window exactly, a window longer than the loop.
SHAPES = [(64, 8), (101, 100), (10, 3), (5, 1), (7, 7), (5, 10)]


def plain_loop(fn, init: torch.Tensor, n_steps: int, non_sequences=()) -> torch.Tensor:
    """What checkpoint_scan must equal: the Python loop a user would write."""
    outs, carry = [], init
    for _ in range(n_steps):
        carry = fn(carry, *non_sequences)
        outs.append(carry)
    return torch.stack(outs)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """Weights every step differently, so a gradient routed to the wrong step would show."""
    weights = torch.linspace(0.5, 1.5, out.shape[0], dtype=out.dtype).view(-1, 1, 1)
    return (out.pow(2) * weights).sum() + out[-1].sum()


def gradients(run, cell: Cell, init: torch.Tensor) -> list[torch.Tensor]:
    wanted = [init, *cell.weights()]
    return list(torch.autograd.grad(loss_of(run()), wanted))


# --------------------------------------------------------------------------- #
# Same numbers as the plain loop
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("n_steps", "every"), SHAPES)
def test_forward_equals_plain_loop_bitwise(n_steps: int, every: int) -> None:
    cell, init = Cell(), make_init()
    out = checkpoint_scan(step, init, n_steps, save_every_n=every, non_sequences=cell.weights())
    assert out.shape == (n_steps, BATCH, DIM)
    assert torch.equal(out, plain_loop(step, init, n_steps, cell.weights()))


@pytest.mark.parametrize(("n_steps", "every"), SHAPES)
def test_backward_equals_plain_loop_bitwise(n_steps: int, every: int) -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    expected = gradients(lambda: plain_loop(step, init, n_steps, cell.weights()), cell, init)
    got = gradients(
        lambda: checkpoint_scan(step, init, n_steps, save_every_n=every, non_sequences=cell.weights()),
        cell,
        init,
    )
    for name, g, e in zip(("init", "weight", "bias"), got, expected):
        assert torch.equal(g, e), name


def test_last_step_gradient_as_in_theano_test() -> None:
    """Theano's case: k=101, save_every_N=100, gradient of result[-1].sum() w.r.t. the non-sequence."""
    cell, init = Cell(torch.float64), make_init(torch.float64, requires_grad=False)
    (expected,) = torch.autograd.grad(plain_loop(step, init, 101, cell.weights())[-1].sum(), cell.weight)
    out = checkpoint_scan(step, init, 101, save_every_n=100, non_sequences=cell.weights())
    (got,) = torch.autograd.grad(out[-1].sum(), cell.weight)
    assert torch.equal(got, expected)


def test_weights_fn_closes_over_get_gradients() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)

    def closed(carry: torch.Tensor) -> torch.Tensor:
        return step(carry, cell.weight, cell.bias)

    expected = gradients(lambda: plain_loop(closed, init, 50), cell, init)
    got = gradients(lambda: checkpoint_scan(closed, init, 50, save_every_n=8), cell, init)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_without_grad_it_is_the_loop() -> None:
    cell, init = Cell(), make_init()
    with torch.no_grad():
        out = checkpoint_scan(step, init, 40, save_every_n=8, non_sequences=cell.weights())
    assert out.grad_fn is None
    assert torch.equal(out, plain_loop(step, init, 40, cell.weights()).detach())


def dropout_grads(cell: Cell, init: torch.Tensor, **scan_options) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients of 60 dropout steps from seed 123: the plain loop, or the scan with these options."""
    torch.manual_seed(123)
    if scan_options:
        out = checkpoint_scan(dropout_step, init, 60, save_every_n=8, non_sequences=cell.weights(), **scan_options)
    else:
        out = plain_loop(dropout_step, init, 60, cell.weights())
    return out.detach(), list(torch.autograd.grad(loss_of(out), [init, *cell.weights()]))


def test_dropout_gets_the_same_masks_when_rng_state_is_preserved() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    out, expected = dropout_grads(cell, init)
    got_out, got = dropout_grads(cell, init, preserve_rng_state=True)
    assert torch.equal(got_out, out)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_dropout_without_preserved_rng_state_recomputes_other_masks() -> None:
    """The flag matters: the forward is the same, but recomputation draws fresh masks."""
    cell, init = Cell(torch.float64), make_init(torch.float64)
    out, expected = dropout_grads(cell, init)
    got_out, got = dropout_grads(cell, init, preserve_rng_state=False)
    assert torch.equal(got_out, out)
    assert not torch.equal(got[1], expected[1])


# --------------------------------------------------------------------------- #
# Memory and recompute: k=1024 steps, a checkpoint every 32
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def measured() -> dict:
    """The plain loop and checkpoint_scan, each measured once (float32, carry (4, 16) = 256 bytes)."""
    cell, init = Cell(), make_init()
    runs = {
        "plain": lambda: plain_loop(step, init, N_STEPS, cell.weights()),
        "scan": lambda: checkpoint_scan(step, init, N_STEPS, save_every_n=EVERY, non_sequences=cell.weights()),
    }
    out: dict = {"carry": init.numel() * init.element_size()}
    for name, run in runs.items():

        def train_step(run=run) -> None:
            run().sum().backward()
            cell.zero_grad(set_to_none=True)

        out[name] = {
            # Storages packed by saved_tensors_hooks; non-reentrant checkpoint
            # saves each window's inputs this way, and nothing of its steps.
            "saved": saved_bytes(cell, run, owners=[]).total,
            "mem": step_memory(train_step, cell),
        }
    out["scan"]["alive"] = alive_after_forward(runs["scan"], cell)
    return out


def alive_after_forward(run, cell: Cell) -> int:
    """Bytes the forward allocated that are still alive when it returns, its output excluded."""
    tracker = CategoryPeakTracker()
    tracker.track_external(cell)
    with tracker:
        result = run()
        snapshot = tracker.get_tracker_snapshot()  # current, not peak
        live = sum(v for dev in snapshot.values() for k, v in dev.items() if getattr(k, "name", "") == "ACT")
        return live - result.untyped_storage().nbytes()


def test_scan_saves_one_carry_per_window(measured: dict) -> None:
    carry, windows = measured["carry"], math.ceil(N_STEPS / EVERY)
    # The 32 window inputs (init is the first), nothing of the 1024 steps.
    assert measured["scan"]["saved"] == windows * carry
    # The plain loop saves every step's carry, and init: 1025 carries.
    assert measured["plain"]["saved"] >= N_STEPS * carry


def test_after_the_forward_only_window_inputs_are_alive(measured: dict) -> None:
    carry = measured["carry"]
    # init was allocated before the forward: 31 new window inputs stay alive.
    assert measured["scan"]["alive"] == (N_STEPS // EVERY - 1) * carry


def test_activation_peak_is_output_plus_inputs_plus_one_window(measured: dict) -> None:
    carry = measured["carry"]
    # The stacked output (1024 carries) is alive in both; the scan adds its 31
    # new window inputs and one running window (its step outputs and their stack).
    bound = (N_STEPS + N_STEPS // EVERY + 2 * EVERY) * carry
    assert measured["scan"]["mem"]["act"] <= bound
    # The plain loop holds the output and one saved carry per step.
    assert measured["plain"]["mem"]["act"] >= 2 * N_STEPS * carry
    # Theano's test_memory, exactly: the whole step's peak is lower too.
    assert measured["scan"]["mem"]["total"] < measured["plain"]["mem"]["total"]


def test_backward_recomputes_one_window_at_a_time(measured: dict) -> None:
    # Recomputed activations are backward temporaries: at most one window's 32 carries more.
    extra = measured["scan"]["mem"]["temp"] - measured["plain"]["mem"]["temp"]
    assert 0 < extra <= EVERY * measured["carry"]


def test_recompute_costs_exactly_one_extra_forward() -> None:
    # Fewer steps than the memory test: FlopCounterMode is slow per op, and the
    # claim (each window replayed once, never twice) does not depend on k.
    n_steps, every = 256, 16
    cell, init = Cell(), make_init()

    def train_step(run) -> None:
        loss_of(run()).backward()
        cell.zero_grad(set_to_none=True)

    plain = step_flops(lambda: train_step(lambda: plain_loop(step, init, n_steps, cell.weights())))
    scan = step_flops(
        lambda: train_step(
            lambda: checkpoint_scan(step, init, n_steps, save_every_n=every, non_sequences=cell.weights())
        )
    )
    with torch.no_grad():
        forward = step_flops(lambda: plain_loop(step, init, n_steps, cell.weights()))
    assert scan - plain == forward > 0


def test_one_window_when_save_every_n_exceeds_n_steps() -> None:
    cell, init = Cell(), make_init()

    def run() -> torch.Tensor:
        return checkpoint_scan(step, init, 10, save_every_n=64, non_sequences=cell.weights())

    saved = saved_bytes(cell, run, owners=[])
    assert saved.total == init.numel() * init.element_size()  # only init, for the single window


# --------------------------------------------------------------------------- #
# Bad arguments: the message names the argument, the value and what would work
# --------------------------------------------------------------------------- #


def scan_with(**overrides) -> torch.Tensor:
    cell = Cell()
    kwargs = dict(fn=step, init=make_init(), n_steps=10, save_every_n=4, non_sequences=cell.weights())
    kwargs |= overrides
    fn, init, n_steps = kwargs.pop("fn"), kwargs.pop("init"), kwargs.pop("n_steps")
    return checkpoint_scan(fn, init, n_steps, **kwargs)


def test_save_every_n_zero_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"save_every_n=0 must be an int >= 1: the number of steps per"):
        scan_with(save_every_n=0)


def test_save_every_n_negative_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"save_every_n=-3 must be an int >= 1"):
        scan_with(save_every_n=-3)


def test_save_every_n_float_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"save_every_n=2\.5 must be an int >= 1: .*about sqrt\(n_steps\)"):
        scan_with(save_every_n=2.5)


def test_save_every_n_bool_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"save_every_n=True must be an int >= 1"):
        scan_with(save_every_n=True)


def test_n_steps_zero_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"n_steps=0 must be an int >= 1, the number of times fn is applied"):
        scan_with(n_steps=0)


def test_n_steps_string_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"n_steps='10' must be an int >= 1"):
        scan_with(n_steps="10")


def test_fn_not_callable_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"fn=42 \(int\) must be callable as fn\(carry, \*non_sequences\)"):
        scan_with(fn=42)


def test_init_not_a_tensor_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"init=\[0\.0, 1\.0\] \(list\) must be a torch\.Tensor.*torch\.tensor"):
        scan_with(init=[0.0, 1.0])


def test_single_tensor_non_sequences_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"non_sequences must be a tuple or list .*got Tensor .*=\(W,\)"):
        scan_with(non_sequences=torch.eye(DIM))


def test_preserve_rng_state_not_bool_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"preserve_rng_state='yes' must be True or False"):
        scan_with(preserve_rng_state="yes")


def test_all_problems_are_reported_together() -> None:
    with pytest.raises(ValueError, match=r"n_steps=0 must be .*; save_every_n=0 must be"):
        scan_with(n_steps=0, save_every_n=0)


def test_fn_changing_the_carry_shape_is_rejected() -> None:
    def widen(carry: torch.Tensor) -> torch.Tensor:
        return torch.cat([carry, carry], dim=-1)

    with pytest.raises(ValueError, match=r"fn must return the next carry, a tensor like init \(\(4, 16\) "
                       r"torch\.float32 on cpu\); at step 0 it returned \(4, 32\) torch\.float32 on cpu"):
        scan_with(fn=widen, non_sequences=())

"""checkpoint_scan(..., snapshots=k, outputs="last"): Griewank's binomial schedule, and the scan that follows it.

The schedule alone (no tensors) on a grid of lengths and snapshot counts: a
valid reversal, never more than ``k`` carries kept, and exactly Griewank's
minimum of steps without grad. Then real scans: ``fn`` called exactly that
many times (counted in ``fn``), the last carry and the gradients equal to
the plain loop's bit for bit, and memory measured with MemTracker as
``tests/test_scan.py`` measures the window scan, in units of one carry.
"""

from __future__ import annotations

import collections
import functools
from math import comb

import pytest
import torch

from ckpt_plugin._compat import CategoryPeakTracker
from ckpt_plugin.engine.scan import revolve
from ckpt_plugin.engine.scan.scan import checkpoint_scan
from ckpt_plugin.measure.memory import saved_bytes, step_memory
from scan_cells import DIM, Cell, dropout_step, make_init, step

STEPS = [1, 2, 3, 5, 10, 37, 100, 1000]
SNAPSHOTS = range(1, 11)


# --------------------------------------------------------------------------- #
# The schedule, without tensors
# --------------------------------------------------------------------------- #


def follow(n_steps: int, snapshots: int) -> dict:
    """Run the schedule on carry indices only, checking each action; what it cost and kept."""
    at: int | None = 0  # index of the current carry; None after a youturn consumed it
    kept, most, advances, reversed_steps = {0}, 1, 0, []
    forward = forward_snapshots = None  # steps and snapshots when the forward ends
    for op, index in revolve.schedule(n_steps, snapshots):
        if op == "advance":
            assert at is not None and index > at, (op, index, at)
            advances, at = advances + index - at, index
        elif op == "takeshot":
            assert at == index and index not in kept
            kept.add(index)
            most = max(most, len(kept))
        elif op == "restore":
            assert index in kept
            at = index
        elif op == "free":
            assert index in kept and index != 0  # init is never dropped
            kept.remove(index)
        elif op == "firsturn":
            assert forward is None and at == index == n_steps  # the forward ends at the output
            forward, forward_snapshots, at = advances, len(kept) - 1, None
        else:
            assert op == "youturn" and forward is not None and at == index
            reversed_steps.append(index)
            at = None
    assert reversed_steps == list(range(n_steps - 1, -1, -1))  # every step once, from the last
    return {"advances": advances, "forward": forward, "taken": forward_snapshots, "most": most, "left": kept}


@pytest.mark.parametrize("n_steps", STEPS)
def test_schedule_is_a_reversal_with_griewanks_minimum_and_at_most_k_carries(n_steps: int) -> None:
    for k in SNAPSHOTS:
        run = follow(n_steps, k)
        assert run["forward"] == n_steps  # the forward is the n steps, nothing more
        assert run["taken"] == min(k, n_steps) - 1  # and takes all the snapshots it may
        assert (run["advances"], n_steps) == revolve.optimal_calls(n_steps, k), k
        assert run["most"] <= k and run["left"] == {0}, k


def griewank(l: int, s: int) -> int:
    """The closed form as the issue states it: t with beta(s, t-1) < l <= beta(s, t), then t*l - beta(s+1, t-1)."""
    def beta(s: int, t: int) -> int:
        return comb(s + t, s) if t >= 0 else 0

    t = next(t for t in range(l + 1) if beta(s, t - 1) < l <= beta(s, t))
    return t * l - beta(s + 1, t - 1)


def test_the_count_is_griewanks_closed_form_for_n_plus_one_steps() -> None:
    """Calls without grad = T(n + 1, k): the forward to x_n is Griewank's sweep to the state before an empty last step."""
    for n in STEPS:
        for k in SNAPSHOTS:
            assert revolve.optimal_calls(n, k) == (griewank(n + 1, k), n)
            assert revolve.repetitions(n + 1, k) == next(t for t in range(n + 2) if comb(k + t, k) >= n + 1)


@functools.cache
def dp(l: int, s: int) -> int:
    """The least steps without grad to reverse l steps by recursive splitting, searched exhaustively."""
    if l == 1:
        return 0
    if s == 1:
        return l * (l - 1) // 2
    return min(j + dp(l - j, s - 1) + dp(j, s) for j in range(1, l))


def test_closed_form_equals_the_exhaustive_search() -> None:
    assert all(revolve.min_advances(l, s) == dp(l, s) for l in range(1, 61) for s in range(1, 8))


def fewest_advances(n: int, k: int) -> int:
    """Every way to run a scan of n steps with at most k snapshots, searched (0-1 BFS): its fewest steps without grad.

    A state is (next step to reverse, current carry, snapshots, forward done);
    only a step without grad costs. The forward must reach x_n before the
    first step is reversed; steps are reversed from the last, each from the
    current carry x_i. This knows nothing of binomials or of Griewank.
    """
    start = (n - 1, 0, frozenset({0}), False)
    best = {start: 0}
    queue = collections.deque([(0, start)])
    while queue:
        cost, state = queue.popleft()
        if cost > best[state]:
            continue
        r, at, kept, done = state
        if r < 0:
            return cost
        moves = [(0, (r, i, kept, done)) for i in kept]  # restore
        moves += [(0, (r, at, kept - {i}, done)) for i in kept if i != 0]  # free
        if at is not None and at < n:
            moves.append((1, (r, at + 1, kept, done)))  # advance one step
        if at is not None and at not in kept and len(kept) < k:
            moves.append((0, (r, at, kept | {at}, done)))  # takeshot
        if not done and at == n:
            moves.append((0, (r, None, kept, True)))  # firsturn: x_n is the output
        if done and at == r:
            moves.append((0, (r - 1, None, kept, done)))  # youturn: step r + 1 with grad, and its backward
        for c, nxt in moves:
            if cost + c < best.get(nxt, cost + c + 1):
                best[nxt] = cost + c
                (queue.appendleft if c == 0 else queue.append)((cost + c, nxt))
    raise AssertionError("no schedule reverses the scan")


def test_no_schedule_at_all_does_better() -> None:
    """The optimum from first principles, for small scans: T(n + 1, k), what the schedule achieves."""
    for n in range(1, 9):
        for k in range(1, 5):
            assert fewest_advances(n, k) == revolve.optimal_calls(n, k)[0], (n, k)


@pytest.mark.parametrize(("n_steps", "expected"), [(1, 1), (2, 3), (10, 55), (1000, 500500)])
def test_one_snapshot_re_advances_every_step_from_init(n_steps: int, expected: int) -> None:
    assert revolve.optimal_calls(n_steps, 1) == (expected, n_steps)  # n(n+1)/2 without grad, the forward included


@pytest.mark.parametrize("n_steps", STEPS)
def test_n_snapshots_keep_every_carry_and_re_advance_nothing(n_steps: int) -> None:
    for k in (n_steps, n_steps + 1, 2 * n_steps):
        assert revolve.optimal_calls(n_steps, k) == (n_steps, n_steps)
        assert follow(n_steps, k)["most"] == n_steps  # x_0 .. x_{n-1}


def test_the_module_docstring_example() -> None:
    actions = revolve.schedule(10, 3)
    assert [tuple(a) for a in actions[:6]] == [
        ("advance", 4), ("takeshot", 4), ("advance", 7), ("takeshot", 7), ("advance", 10), ("firsturn", 10)
    ]
    assert revolve.optimal_calls(10, 3) == (18, 10)
    assert revolve.optimal_calls(1024, 8) == (4410, 1024)  # scan.py's example


def test_schedule_rejects_non_positive_arguments() -> None:
    with pytest.raises(ValueError, match=r"schedule: n_steps=0 and snapshots=3 must both be >= 1"):
        revolve.schedule(0, 3)


# --------------------------------------------------------------------------- #
# Real scans: calls of fn, values and gradients against the plain loop
# --------------------------------------------------------------------------- #


class Counted:
    """``fn`` that counts its calls, with grad and without (one instance per test: no shared counter)."""

    def __init__(self, fn=step) -> None:
        self.fn, self.without, self.with_grad = fn, 0, 0

    def __call__(self, carry: torch.Tensor, *args) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.with_grad += 1
        else:
            self.without += 1
        return self.fn(carry, *args)


def plain_loop(fn, init: torch.Tensor, n_steps: int, non_sequences=()) -> torch.Tensor:
    """What checkpoint_scan(outputs="last") must equal: the Python loop a user would write."""
    carry = init
    for _ in range(n_steps):
        carry = fn(carry, *non_sequences)
    return carry


def last(fn, init, n_steps, k, non_sequences=(), **options) -> torch.Tensor:
    return checkpoint_scan(fn, init, n_steps, snapshots=k, outputs="last", non_sequences=non_sequences, **options)


def loss_of(h: torch.Tensor) -> torch.Tensor:
    return (h.pow(2) * torch.linspace(0.5, 1.5, DIM, dtype=h.dtype)).sum()


# A subset of the schedule's grid: each with a float64 (4, 16) carry.
RUNS = [(n, k) for n in (1, 2, 5, 10, 37) for k in (1, 2, 3, 5, 10)] + [(100, 3), (100, 7)]


@pytest.mark.parametrize(("n_steps", "k"), RUNS)
def test_calls_of_fn_and_gradients_bitwise(n_steps: int, k: int) -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    wanted = [init, *cell.weights()]
    expected_h = plain_loop(step, init, n_steps, cell.weights())
    expected = torch.autograd.grad(loss_of(expected_h), wanted)

    fn = Counted()
    h = last(fn, init, n_steps, k, cell.weights())
    assert (fn.without, fn.with_grad) == (n_steps, 0)  # the forward: every step once, without grad
    assert torch.equal(h, expected_h)
    got = torch.autograd.grad(loss_of(h), wanted)
    assert (fn.without, fn.with_grad) == revolve.optimal_calls(n_steps, k)
    for name, g, e in zip(("init", "weight", "bias"), got, expected):
        assert torch.equal(g, e), name


def test_float32_and_backward_into_grad_attributes() -> None:
    cell, init = Cell(torch.float32), make_init(torch.float32)
    loss_of(plain_loop(step, init, 60, cell.weights())).backward()
    expected = [t.grad.clone() for t in (init, *cell.weights())]
    init.grad = None
    cell.zero_grad(set_to_none=True)
    loss_of(last(step, init, 60, 4, cell.weights())).backward()
    assert all(torch.equal(t.grad, e) for t, e in zip((init, *cell.weights()), expected))


def test_init_without_grad_and_non_tensor_non_sequences() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64, requires_grad=False)

    def scaled(carry, weight, bias, scale):
        return step(carry, weight, bias) * scale

    args = (*cell.weights(), 0.9)
    expected = torch.autograd.grad(loss_of(plain_loop(scaled, init, 20, args)), cell.weights())
    got = torch.autograd.grad(loss_of(last(scaled, init, 20, 3, args)), cell.weights())
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_module_cell_gets_gradients_for_its_parameters() -> None:
    """fn closes over its weights (an nn.Module's parameters): they are found and get their gradients."""
    cell, init = Cell(torch.float64), make_init(torch.float64)
    wanted = [init, *cell.weights()]
    expected = torch.autograd.grad(loss_of(plain_loop(cell, init, 30)), wanted)
    got = torch.autograd.grad(loss_of(last(cell, init, 30, 4)), wanted)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_closed_over_non_leaf_passes_its_gradient_on() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    weight = cell.weight * scale  # not a leaf: its gradient must reach scale and cell.weight

    def closed(carry):
        return step(carry, weight, cell.bias)

    wanted = [scale, cell.weight, cell.bias]
    expected = torch.autograd.grad(loss_of(plain_loop(closed, init, 25)), wanted, retain_graph=True)
    got = torch.autograd.grad(loss_of(last(closed, init, 25, 3)), wanted)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def dropout_run(cell: Cell, init: torch.Tensor, **scan_options) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Last carry, gradients and the next random draw after 40 dropout steps from seed 123."""
    torch.manual_seed(123)
    if scan_options:
        h = last(dropout_step, init, 40, 3, cell.weights(), **scan_options)
    else:
        h = plain_loop(dropout_step, init, 40, cell.weights())
    grads = torch.autograd.grad(loss_of(h), [init, *cell.weights()])
    return h.detach(), list(grads), torch.rand(3)


def test_dropout_replays_the_same_masks_when_rng_state_is_preserved() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    h, expected, after = dropout_run(cell, init)
    got_h, got, got_after = dropout_run(cell, init, preserve_rng_state=True)
    assert torch.equal(got_h, h)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(got_after, after)  # backward left the global RNG where the plain loop's did


def test_dropout_without_preserved_rng_state_recomputes_other_masks() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    h, expected, _ = dropout_run(cell, init)
    got_h, got, _ = dropout_run(cell, init, preserve_rng_state=False)
    assert torch.equal(got_h, h)  # the forward is the plain loop's
    assert not torch.equal(got[1], expected[1])


def test_autocast_is_replayed_in_backward() -> None:
    """Each step runs again under the forward's autocast, so in bfloat16 too the gradients are the loop's.

    Bit for bit against a loop without autocast's weight cache: with it, the
    loop casts W once for all steps and sums their gradients in bfloat16
    before casting back, where any recomputation (torch's checkpoint too)
    casts per step and sums in float32; W's gradients agree to bfloat16 precision.
    """
    cell, init = Cell(torch.float32), make_init(torch.float32)
    wanted = [init, *cell.weights()]
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        h_plain = plain_loop(step, init, 12, cell.weights())
        h = last(step, init, 12, 3, cell.weights())
    expected = torch.autograd.grad(loss_of(h_plain), wanted)
    got = torch.autograd.grad(loss_of(h), wanted)
    assert torch.equal(h, h_plain)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached = torch.autograd.grad(loss_of(plain_loop(step, init, 12, cell.weights())), wanted)
    assert torch.equal(got[0], cached[0]) and torch.equal(got[2], cached[2])  # b is added, not cast
    assert (got[1] - cached[1]).abs().max() <= 2**-6 * cached[1].abs().max()  # 12 bfloat16 sums, 8-bit mantissa


def test_without_grad_it_is_the_loop() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    fn = Counted()
    with torch.no_grad():
        h = last(fn, init, 40, 3, cell.weights())
    assert h.grad_fn is None and fn.without == 40
    assert torch.equal(h, plain_loop(step, init, 40, cell.weights()).detach())


def test_nothing_to_differentiate_keeps_nothing() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64, requires_grad=False)
    h = last(step, init, 40, 3, tuple(w.detach() for w in cell.weights()))
    assert h.grad_fn is None and not h.requires_grad


def test_second_backward_is_refused() -> None:
    cell, init = Cell(torch.float64), make_init(torch.float64)
    loss = loss_of(last(step, init, 10, 3, cell.weights()))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"outputs='last'\): a second backward through the same scan; .*run the scan again"):
        loss.backward()


# --------------------------------------------------------------------------- #
# Memory: k carries and one step, whatever n (float32, carry (4, 16) = 256 bytes)
# --------------------------------------------------------------------------- #

MEMORY = [(100, 4), (64, 8)]  # long enough for the forward to take all k - 1 snapshots


def train_step(run, cell: Cell, init: torch.Tensor):
    def one() -> None:
        run().sum().backward()  # a loss that allocates nothing carry-sized
        cell.zero_grad(set_to_none=True)
        init.grad = None

    return one


@pytest.fixture(scope="module")
def measured() -> dict:
    """Each MEMORY case, the plain loop of 100 steps and the plain loop of one step, measured once."""
    cell, init = Cell(torch.float32), make_init(torch.float32)
    out: dict = {"carry": init.numel() * init.element_size(), "params": sum(p.nbytes for p in cell.parameters())}
    for n, k in MEMORY:
        run = functools.partial(last, step, init, n, k, cell.weights())
        tracker = CategoryPeakTracker()
        tracker.track_external(cell)
        with tracker:
            h = run()
            snapshot = tracker.get_tracker_snapshot()  # current, not peak
        live = sum(v for dev in snapshot.values() for c, v in dev.items() if getattr(c, "name", "") == "ACT")
        out[n, k] = {
            "alive": live - h.untyped_storage().nbytes(),
            "saved": saved_bytes(cell, run, owners=[]).total,
            "mem": step_memory(train_step(run, cell, init), cell),
        }
        del h
    for n in (1, 100):
        run = functools.partial(plain_loop, step, init, n, cell.weights())
        out["plain", n] = step_memory(train_step(run, cell, init), cell)
    return out


@pytest.mark.parametrize(("n", "k"), MEMORY)
def test_after_the_forward_only_the_snapshots_are_alive(measured: dict, n: int, k: int) -> None:
    # init was allocated before: k - 1 new carries, nothing of the n steps.
    assert measured[n, k]["alive"] == (k - 1) * measured["carry"]
    # Only init goes through saved_tensors_hooks (saved for its version check); the snapshots are held apart.
    assert measured[n, k]["saved"] == measured["carry"]


@pytest.mark.parametrize(("n", "k"), MEMORY)
def test_activation_peak_is_the_snapshots_and_one_step(measured: dict, n: int, k: int) -> None:
    # In the forward: k - 1 snapshots, the carry a step starts from and the cell's two
    # temporaries (h @ W, then + b), whatever n; the plain loop keeps a carry per step.
    assert measured[n, k]["mem"]["act"] == (k + 2) * measured["carry"]
    assert measured["plain", 100]["act"] >= 100 * measured["carry"]


@pytest.mark.parametrize(("n", "k"), MEMORY)
def test_step_peak_is_one_plain_step_plus_the_snapshots(measured: dict, n: int, k: int) -> None:
    """The whole training step's peak, exactly: what one step of the plain loop peaks at, plus k - 1
    snapshots, the carry re-advanced to and the gradient coming into it (2 carries), and one
    parameter-sized buffer: the gradient sums the reversal hands back at the end."""
    carry, params = measured["carry"], measured["params"]
    assert measured[n, k]["mem"]["total"] == measured["plain", 1]["total"] + (k + 1) * carry + params
    assert measured[n, k]["mem"]["total"] < measured["plain", 100]["total"]


# --------------------------------------------------------------------------- #
# Bad arguments: the message names the argument, the value and what would work
# --------------------------------------------------------------------------- #


def scan_with(**overrides) -> torch.Tensor:
    cell = Cell(torch.float64)
    kwargs = {"fn": step, "init": make_init(torch.float64), "n_steps": 10, "snapshots": 3, "outputs": "last",
              "non_sequences": cell.weights()}
    kwargs |= overrides
    fn, init, n_steps = kwargs.pop("fn"), kwargs.pop("init"), kwargs.pop("n_steps")
    kwargs = {key: value for key, value in kwargs.items() if value is not ...}  # ... leaves an argument out
    return checkpoint_scan(fn, init, n_steps, **kwargs)


@pytest.mark.parametrize("value", [0, -2])
def test_snapshots_below_one_is_rejected(value: int) -> None:
    with pytest.raises(ValueError, match=rf"^checkpoint_scan: snapshots={value} must be an int >= 1: the most "
                       r"carries kept at once, init included \(1 recomputes every step from init, n_steps or "
                       r"more keeps every carry\)$"):
        scan_with(snapshots=value)


@pytest.mark.parametrize(("value", "shown"), [(2.5, r"2\.5"), (True, "True"), ("4", "'4'")])
def test_snapshots_not_an_int_is_rejected(value, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"snapshots={shown} must be an int >= 1: the most carries kept"):
        scan_with(snapshots=value)


def test_last_without_snapshots_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint_scan: snapshots is needed with outputs='last': an int >= 1, "
                       r"the most carries kept at once, init included$"):
        scan_with(snapshots=...)


def test_save_every_n_with_last_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint_scan: save_every_n=8 is for outputs='all' \(windows of the "
                       r"stacked carries\); with outputs='last' snapshots=k alone sets the schedule$"):
        scan_with(save_every_n=8)


def test_snapshots_with_all_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint_scan: snapshots=3 is for outputs='last' \(the last carry "
                       r"only, Griewank's binomial schedule\); with outputs='all' every carry is returned and "
                       r"save_every_n sets the windows$"):
        scan_with(outputs="all", save_every_n=4)


def test_all_without_save_every_n_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint_scan: save_every_n is needed with outputs='all' \(the "
                       r"default\): an int >= 1, the number of steps per checkpointed window; or pass "
                       r"outputs='last' and snapshots=k for the last carry only$"):
        scan_with(outputs=..., snapshots=...)


@pytest.mark.parametrize(("value", "shown"), [("first", "'first'"), ("LAST", "'LAST'"), (None, "None")])
def test_unknown_outputs_is_rejected(value, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^checkpoint_scan: outputs={shown} must be 'all' \(every carry "
                       r"stacked, with save_every_n\) or 'last' \(the last carry only, with snapshots\)$"):
        scan_with(outputs=value)


def test_all_problems_are_reported_together() -> None:
    with pytest.raises(ValueError, match=r"n_steps=0 must be .*; save_every_n=2 is for outputs='all'.*; "
                       r"snapshots=0 must be an int >= 1"):
        scan_with(n_steps=0, save_every_n=2, snapshots=0)


def test_fn_changing_the_carry_shape_is_rejected_at_its_step() -> None:
    def widen(carry: torch.Tensor) -> torch.Tensor:
        return torch.cat([carry, carry], dim=-1)

    with pytest.raises(ValueError, match=r"fn must return the next carry, a tensor like init \(\(4, 16\) "
                       r"torch\.float64 on cpu\); at step 0 it returned \(4, 32\) torch\.float64 on cpu"):
        scan_with(fn=widen, non_sequences=())

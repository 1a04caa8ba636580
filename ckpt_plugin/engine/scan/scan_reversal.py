"""``checkpoint_scan(..., outputs="last")``: the carry-only scan run along Griewank's binomial schedule.

The schedule itself is plain data (:mod:`.revolve`); this module runs it on
tensors: the forward without grad, keeping the snapshots it asks for, and one
autograd node whose backward restores, re-advances and reverses each step
with grad. What stays alive and how often ``fn`` runs: :mod:`.scan`'s
docstring; why it is optimal: :mod:`.revolve`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import get_device_states, set_device_states

from ckpt_plugin.engine.scan.revolve import Action, actions

__all__ = ["last_carry"]

# One checked application of fn: step(fn, carry, non_sequences, index) -> the next carry (scan._step).
Step = Callable[[Callable[..., torch.Tensor], torch.Tensor, tuple[Any, ...], int], torch.Tensor]


class _ClosedOver(TorchFunctionMode):
    """Records the tensors that require grad which ``fn`` reaches other than through its arguments.

    A module's parameters, a weight a closure captured: the reversal runs
    each step again in backward and must hand their gradients back, so they
    become inputs of :class:`_Reverse` like the non-sequences (the window
    scan gets the same from non-reentrant checkpointing). Seen in the
    forward, where every op of every step passes through here.
    """

    def __init__(self, known: list[Any]) -> None:
        super().__init__()
        self.known = {id(t) for t in known}
        self.tensors: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Arguments and the lists in them (torch.cat), not a full pytree walk: every op of
        # every forward step comes through here, and an empty mode already doubles a small
        # step's time.
        kwargs = kwargs or {}
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in self.known:
                    self.known.add(id(t))
                    self.tensors.append(t)
        return func(*args, **kwargs)


class _Reversal:
    """A scan run along :func:`.revolve.actions`: the forward up to ``firsturn``, later the backward.

    Holds what the forward leaves for backward, and nothing of the output:
    the remaining actions, the snapshots it took (carry and RNG state, by
    carry index) and the autocast state of the forward, which every replayed
    step runs under again, as torch's checkpoint does.
    """

    def __init__(
        self, fn: Callable[..., torch.Tensor], step: Step, plan: Iterator[Action], preserve_rng_state: bool,
        devices: list[Any],
    ) -> None:
        self.fn, self.step, self.plan, self.devices = fn, step, plan, devices
        self.preserve_rng_state = preserve_rng_state
        self.device_ids = get_device_states(*devices)[0] if preserve_rng_state else []
        self.snapshots: dict[int, tuple[torch.Tensor | None, Any]] = {}
        device_type = next((t.device.type for t in devices if t.device.type not in ("cpu", "meta")), None)
        self.device_type = device_type or "cuda"  # set_device_states' default, for the ids get_device_states finds
        self.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
            for d in dict.fromkeys(["cpu", *([device_type] if device_type else [])])
            if torch.amp.is_autocast_available(d)
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.output: torch.Tensor | None = None

    def rng_state(self) -> Any:
        return (torch.get_rng_state(), get_device_states(*self.devices)) if self.preserve_rng_state else None

    def set_rng_state(self, state: Any) -> None:
        if state is not None:
            cpu, (ids, states) = state
            torch.set_rng_state(cpu)
            set_device_states(ids, states, device_type=self.device_type)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """The forward's autocast state, for a step run again in backward."""
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                )
            yield

    def forward(self, init: torch.Tensor, non_sequences: tuple[Any, ...]) -> torch.Tensor:
        """Steps without grad up to ``firsturn``, keeping the snapshots the schedule asks for; the last carry."""
        self.snapshots[0] = (None, self.rng_state())  # init itself comes back from the saved tensors
        carry, at = init, 0
        for op, index in self.plan:
            if op == "advance":
                for i in range(at, index):
                    carry = self.step(self.fn, carry, non_sequences, i)
                at = index
            elif op == "takeshot":
                self.snapshots[index] = (carry, self.rng_state())
            else:
                assert op == "firsturn" and index == at, (op, index, at)
                return carry
        raise AssertionError("the schedule has no firsturn")

    def backward(
        self, grad: torch.Tensor, init: torch.Tensor, inputs: list[Any], n_non_sequences: int, needs: tuple[bool, ...]
    ) -> list[torch.Tensor | None]:
        """The rest of the schedule: each step from the last run again with grad and backpropagated.

        ``inputs`` are the non-sequences and then the closed-over tensors,
        ``needs`` says for ``init`` and each input whether it wants a
        gradient; returns those gradients, ``None`` where not wanted.
        """
        non_sequences = list(inputs[:n_non_sequences])
        sums: list[torch.Tensor | None] = [None] * len(inputs)
        carry: torch.Tensor | None = None
        at = 0
        with torch.random.fork_rng(
            devices=self.device_ids, enabled=self.preserve_rng_state, device_type=self.device_type
        ):
            for op, index in self.plan:
                if op == "advance":
                    with torch.no_grad(), self.replaying():
                        for _ in range(at, index):
                            carry = self.fn(carry, *non_sequences)
                    at = index
                elif op == "takeshot":
                    self.snapshots[index] = (carry, self.rng_state())
                elif op == "restore":
                    kept, state = self.snapshots[index]
                    carry, at = (init if index == 0 else kept), index
                    self.set_rng_state(state)
                elif op == "free":
                    del self.snapshots[index]
                else:
                    assert op == "youturn" and index == at and carry is not None, (op, index, at)
                    grad = self.turn(carry, grad, non_sequences, inputs, needs, index == 0, sums)
                    carry = None  # x_index: its step's graph went with the turn
        self.plan, self.snapshots = None, {}
        return [grad if needs[0] else None, *sums]

    def turn(
        self,
        carry: torch.Tensor,
        grad: torch.Tensor | None,
        non_sequences: list[Any],
        inputs: list[Any],
        needs: tuple[bool, ...],
        first: bool,
        sums: list[torch.Tensor | None],
    ) -> torch.Tensor | None:
        """One step from ``carry`` with grad; ``grad`` of its output backpropagated. Returns the carry's gradient.

        The non-sequences that want a gradient are given to ``fn`` as detached
        leaves, so the step's graph ends at them; the closed-over tensors are
        reached by ``fn`` itself. Their gradients are added to ``sums`` from
        the last step to the first, in the order the plain loop's backward
        adds them, in place into a copy of the first (one step's gradient and
        the sum alive, never a third buffer for ``sum + g``). Nothing of the
        step outlives this call.
        """
        if grad is None:  # a later step did not depend on its carry: nothing flows back to this one
            return None
        carry_grad = not first or needs[0]  # the first step's carry is init
        wanted = [j for j, need in enumerate(needs[1:]) if need]
        args = list(non_sequences)
        with torch.enable_grad(), self.replaying():
            x = carry.detach().requires_grad_(carry_grad)
            for j in wanted:
                if j < len(args):
                    args[j] = args[j].detach().requires_grad_()
            out = self.fn(x, *args)
        wrt = [x] if carry_grad else []
        wrt += [args[j] if j < len(args) else inputs[j] for j in wanted]
        if not wrt or not out.requires_grad:  # fn reached nothing that wants a gradient
            return None
        grads = list(torch.autograd.grad(out, wrt, grad, allow_unused=True))
        carry_grad_out = grads.pop(0) if carry_grad else None
        for j, g in zip(wanted, grads):
            if g is None:
                continue
            if sums[j] is None:
                sums[j] = g.clone()  # g may be a view of another tensor (autograd's own): never written to
            else:
                sums[j].add_(g)
        return carry_grad_out


class _Reverse(torch.autograd.Function):
    """The last carry of a :class:`_Reversal` as an autograd node over ``init`` and the other inputs."""

    @staticmethod
    def forward(ctx: Any, reversal: _Reversal, n_non_sequences: int, init: torch.Tensor, *inputs: Any) -> torch.Tensor:
        # The steps ran before apply, under the closed-over capture that found the tail of
        # ``inputs``; the output is handed over and not kept, or the graph would hold itself.
        output, reversal.output = reversal.output, None
        ctx.reversal, ctx.n_non_sequences = reversal, n_non_sequences
        ctx.tensor_at = [isinstance(t, torch.Tensor) for t in inputs]
        ctx.others = [None if is_tensor else t for t, is_tensor in zip(inputs, ctx.tensor_at)]
        # Saved, not just referenced: an in-place change before backward is an error, not a wrong gradient.
        ctx.save_for_backward(init, *(t for t in inputs if isinstance(t, torch.Tensor)))
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reversal: _Reversal = ctx.reversal
        if reversal.plan is None:
            raise RuntimeError(
                "checkpoint_scan(outputs='last'): a second backward through the same scan; its snapshots are "
                "freed as backward uses them (retain_graph=True cannot keep them): run the scan again"
            )
        init, *tensors = ctx.saved_tensors
        it = iter(tensors)
        inputs = [next(it) if is_tensor else other for is_tensor, other in zip(ctx.tensor_at, ctx.others)]
        grads = reversal.backward(grad, init, inputs, ctx.n_non_sequences, ctx.needs_input_grad[2:])
        return (None, None, *grads)


def last_carry(
    fn: Callable[..., torch.Tensor],
    step: Step,
    init: torch.Tensor,
    n_steps: int,
    snapshots: int,
    non_sequences: tuple[Any, ...],
    preserve_rng_state: bool,
) -> torch.Tensor:
    """``checkpoint_scan(..., outputs="last")``: the forward of the binomial schedule, then its node."""
    if not torch.is_grad_enabled():
        carry = init  # nothing will be reversed: the loop itself
        for i in range(n_steps):
            carry = step(fn, carry, non_sequences, i)
        return carry
    tensors = [t for t in (init, *non_sequences) if isinstance(t, torch.Tensor)]
    reversal = _Reversal(fn, step, actions(n_steps, snapshots), preserve_rng_state, tensors)
    with torch.no_grad(), _ClosedOver(tensors) as closed_over:
        reversal.output = reversal.forward(init, non_sequences)
    inputs = (*non_sequences, *closed_over.tensors)
    if not any(t.requires_grad for t in tensors + closed_over.tensors):
        return reversal.output  # nothing to differentiate: the snapshots go with the reversal
    return _Reverse.apply(reversal, len(non_sequences), init, *inputs)

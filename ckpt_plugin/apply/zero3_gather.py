"""ZeRO-3's gathered parameters, played on the module's fake step: what DeepSpeed's parameter coordinator holds
whole at each moment of a rank's step (issue #43).

Under ZeRO-3 a rank keeps its partition of each parameter; DeepSpeed gathers a module's parameters whole before
it runs (forward, backward, a checkpoint's recomputation), prefetches those the trace of the step before says come
next, and releases them after, unless they are used again soon. When they are gathered decides the step's peak
as much as the activations do, and both move with the plan. So rather than add the two, :class:`Gathering` plays
DeepSpeed's rules on the fake step itself, as its modules run, allocating on fake tensors what DeepSpeed allocates
(``runtime/zero/partitioned_param_coordinator.py`` and ``partition_parameters.py``, DeepSpeed 0.19):

- a fetch of several parameters gathers them into one flat buffer (each one's partition times the world), then
  copies each out whole when the first of them is waited for; the buffer lives until the last of them is;
  one parameter alone is gathered into a buffer of its own, which it keeps;
- with the step's trace complete (from its second step on; this plays the first step too), each fetch
  prefetches the next parameters of the trace, up to ``stage3_prefetch_bucket_size`` elements and
  ``stage3_max_live_parameters`` whole at once;
- a module's parameters are released after it runs unless the trace uses them again within
  ``stage3_max_reuse_distance`` elements, or a prefetch has already fetched them for a later use;
- parameters of at most ``stage3_param_persistence_threshold`` elements (up to
  ``stage3_model_persistence_threshold`` in all) are never partitioned: the fake step holds them whole anyway;
- at backward's end, what a module whose backward hook never fired (its inputs need no gradient) still holds is
  released;
- ``torch.nn.functional.linear`` is DeepSpeed's (``memory_efficient_linear``, on by default), which saves the
  weight itself for backward, not a view of its gathered data; what a checkpoint's recomputation saves is kept,
  gathered, until its backward (DeepSpeed's own behaviour: the parameters' data is swapped here as it swaps it).

The gathered tensors are filed as parameters in the measurement. The step's own whole copies of the partitioned
parameters are still there: :func:`apply.zero3.rank_step3` takes them out.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
import torch
from torch import nn

from ckpt_plugin._compat import ModTracker, as_parameter, at_backward_end
from ckpt_plugin.engine.deepspeed import memory_efficient_linear

_NEVER = -10**10  # the step a parameter was last fetched for, before any (DeepSpeed's int(-1e10))


@dataclass(frozen=True)
class Zero3:
    """What a ZeRO-3 rank's step depends on, from the DeepSpeed config (``lightning/zero.py`` reads it)."""

    world: int
    reduce_bucket_size: int  # elements
    prefetch_bucket_size: int = 50_000_000  # elements; DeepSpeed's defaults (runtime/zero/config.py)
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    memory_efficient_linear: bool = True
    # Offload to host memory (``offload_optimizer``: the float32 master copy, its gradients and the optimizer's
    # state; ``offload_param``: the parameters' partitions). ``host_is_device``: the device is the host (a CPU
    # run, DeepSpeed's CPU accelerator): what is offloaded stays on it and counts in its step.
    offload_optimizer: bool = False
    offload_param: bool = False
    host_is_device: bool = False
    # The module's dtype as DeepSpeed casts it (bf16/fp16): its partitions', gradients' and the reduce buffer's
    # (DeepSpeed's defaults: gradients accumulated and communicated in the module's dtype); the master copy float32.
    dtype: torch.dtype = torch.float32

    @property
    def element(self) -> int:
        """Bytes of one element in the module's dtype."""
        return self.dtype.itemsize

    def partition(self, numel: int) -> int:
        """Elements of a rank's partition of a parameter of ``numel`` elements (padded to the world)."""
        return math.ceil(numel / self.world)


def persistent(model: nn.Module, zero: Zero3) -> set[int]:
    """Ids of ``model``'s parameters ZeRO-3 keeps whole, in DeepSpeed's order (``mark_persistent_parameters``)."""
    kept: set[int] = set()
    total = 0
    for _name, p in model.named_parameters():
        if p.numel() + total > zero.model_persistence_threshold:
            continue
        if p.numel() <= zero.param_persistence_threshold:
            kept.add(id(p))
            total += p.numel()
    return kept


class _Handle:
    """One all-gather in flight: its parameters and the flat buffer they arrive in, held for as long as the
    handle is (``Gathering.inflight``: until the last of its parameters is waited for)."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor | None) -> None:
        self.params, self.buffer, self.complete = params, buffer, False


class Gathering:
    """DeepSpeed's parameter coordinator, played on ``model``'s fake step (module docstring)."""

    def __init__(self, model: nn.Module, zero: Zero3, redirected: bool = False) -> None:
        self.zero, self.root, self.redirected = zero, model, redirected
        self.members = {id(m) for m in model.modules()}
        self.kept = persistent(model, zero)
        self.index = {id(p): i for i, p in enumerate(model.parameters())}  # DeepSpeed's ds_id order
        self.gathered: dict[int, torch.Tensor] = {}  # id(param) -> what holds it whole
        self.inflight: dict[int, _Handle] = {}
        self.active: dict[int, set[int]] = defaultdict(set)  # id(param) -> modules using it
        self.order: list[nn.Module] = []  # the trace: modules in the order they were fetched
        self.mode = "invalid"  # -> "record" (the first step) -> "complete"
        self.trace: tuple[tuple[nn.Parameter, int], ...] = ()
        self.running = False
        self.backward_open: dict[int, nn.Module] = {}
        self.deferred: list[nn.Parameter] = []  # released in backward, at the next fetch (release())
        self.queue: deque[tuple[nn.Parameter, int]] = deque()
        self.fetched_for: dict[int, int] = defaultdict(lambda: _NEVER)
        self.step = self.available = 0
        # The partitioned parameters' own whole tensors (the fake step's), kept aside while the step runs on what
        # is gathered: each parameter's data is what DeepSpeed leaves in it (empty, or gathered), so that what
        # the step's ops keep of it (a checkpoint's recomputation keeps the gathered weights it saves until its
        # backward reads them) is kept as DeepSpeed's is.
        self.params = {id(p): p for p in model.parameters() if self._partitioned(p)}
        self.whole: dict[int, torch.Tensor] = {i: p.data for i, p in self.params.items()}

    # the step's bounds --------------------------------------------------------------------------------------

    def _reset(self) -> None:
        if self.mode == "record":
            self.trace = tuple((p, step) for step, m in enumerate(self.order) for p in self._direct(m))
            self.mode = "complete"
        elif self.mode == "invalid":
            self.order, self.mode = [], "record"
        self.queue = deque(self.trace)
        self.fetched_for = defaultdict(lambda: _NEVER)
        self.step = self.available = 0

    def _direct(self, m: nn.Module) -> list[nn.Parameter]:
        return sorted({id(p): p for p in m.parameters(recurse=False)}.values(), key=lambda p: self.index.get(id(p), 0))

    def _numel(self, p: nn.Parameter) -> int:
        """Elements of ``p`` whole (its data may be empty now)."""
        whole = self.whole.get(id(p))
        return whole.numel() if whole is not None else p.numel()

    def _partitioned(self, p: nn.Parameter) -> bool:
        return id(p) not in self.kept and id(p) in self.index

    # fetch and release --------------------------------------------------------------------------------------

    def _gather(self, params: list[nn.Parameter]) -> None:
        todo = [p for p in params if self._partitioned(p) and id(p) not in self.gathered and id(p) not in self.inflight]
        if not todo:
            return
        self.available += sum(self._numel(p) for p in todo)
        if len(todo) == 1:  # a buffer of its own, which the parameter keeps (a view of it)
            p = todo[0]
            handle = _Handle(todo, None)
            self._hold(p, self._alloc(p, self.zero.partition(self._numel(p)) * self.zero.world))
            handle.complete = True
        else:
            numel = sum(self.zero.partition(self._numel(p)) for p in todo) * self.zero.world
            handle = _Handle(todo, self._alloc(todo[0], numel))
        for p in todo:
            self.inflight[id(p)] = handle

    def _wait(self, p: nn.Parameter) -> None:
        handle = self.inflight.pop(id(p), None)
        if handle is None or handle.complete:
            return
        for q in handle.params:  # each copied out whole when the first is waited for
            self._hold(q, self._alloc(q, self._numel(q)))
        handle.complete = True  # its flat buffer goes with it, once the last of its parameters is waited for

    def _alloc(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        t = like.new_empty((numel,), requires_grad=False)
        as_parameter(t)
        return t

    def _hold(self, p: nn.Parameter, buffer: torch.Tensor) -> None:
        self.gathered[id(p)] = buffer
        p.data = buffer[:self._numel(p)].view(self.whole[id(p)].shape)

    def _release(self, p: nn.Parameter) -> None:
        if id(p) in self.gathered and not self.active[id(p)]:
            del self.gathered[id(p)]
            p.data = p.data.new_empty((0,))  # DeepSpeed's free_param
            self.available -= self._numel(p)

    def partition_all(self) -> None:
        """Every partitioned parameter left empty, as DeepSpeed leaves it between steps."""
        for i, p in self.params.items():
            if i not in self.gathered:
                p.data = p.data.new_empty((0,))

    def restore(self) -> None:
        """Every partitioned parameter whole again (its own tensor): for the optimizer's step on the fake step's
        whole gradients, and after."""
        for i, p in self.params.items():
            p.data = self.whole[i]
        self.gathered.clear()
        self.inflight.clear()

    def fetch(self, m: nn.Module, forward: bool) -> None:
        if id(m) not in self.members:
            return
        deferred, self.deferred = self.deferred, []
        self._release_now(deferred)
        if forward and not self.running:  # a step starts
            self.running = True
            self.partition_all()
            if self.redirected:  # the step runs as a call of the root: a reset, the root's own fetch (see gathering)
                self._reset()
                self._fetch(self.root, forward=True)
        if forward and m is self.root:  # DeepSpeed resets the step in a forward pre-hook of its module
            self._reset()
        self._fetch(m, forward)

    def _fetch(self, m: nn.Module, forward: bool) -> None:
        if self.mode == "complete" and (self.step >= len(self.order) or self.order[self.step] is not m):
            self.mode, self.trace, self.order = "invalid", (), []  # DeepSpeed invalidates the trace
        if self.mode == "record":
            self.order.append(m)
        if not forward:
            if not self.backward_open:
                at_backward_end(self._backward_end)
            self.backward_open[id(m)] = m
        params = self._direct(m)
        self._gather(params)
        for p in params:
            self.active[id(p)].add(id(m))
            self._wait(p)
        if self.mode == "complete":
            self._prefetch(params)
        self.step += 1

    def _prefetch(self, params: list[nn.Parameter]) -> None:
        fresh = {id(p) for p in params if self.fetched_for[id(p)] < self.step}
        seen: set[int] = set()
        while self.queue and len(seen) < len(fresh):
            p, used_at = self.queue.popleft()
            self.fetched_for[id(p)] = used_at
            seen.add(id(p))
        room = min(self.zero.max_live_parameters - self.available, self.zero.prefetch_bucket_size)
        chosen: dict[int, nn.Parameter] = {}
        numel = 0
        while self.queue and numel < room:
            p, used_at = self.queue.popleft()
            self.fetched_for[id(p)] = max(self.fetched_for[id(p)], used_at)
            if self._partitioned(p) and id(p) not in self.gathered and id(p) not in self.inflight \
                    and id(p) not in chosen:
                chosen[id(p)] = p
                numel += self._numel(p)
        if chosen:
            self._gather(list(chosen.values()))

    def release(self, m: nn.Module, forward: bool) -> None:
        if id(m) not in self.members:
            return
        params = self._direct(m)
        going = {id(p) for p in params if self._partitioned(p)}
        if self.mode == "complete":
            going = {i for i in going if self.fetched_for[i] <= self.step}
            traversed = 0
            for later in self.order[self.step:]:
                if traversed >= self.zero.max_reuse_distance:
                    break
                for p in self._direct(later):
                    going.discard(id(p))
                    traversed += self._numel(p)
        if not forward:
            self.backward_open.pop(id(m), None)
        for p in params:
            self.active[id(p)].discard(id(m))
        released = [p for p in params if id(p) in going]
        if forward:
            self._release_now(released)
        else:
            # DeepSpeed releases in a node of the graph (on the module's inputs), which autograd runs after the
            # parameters' gradients are accumulated (AccumulateGrad goes first); the hook here fires before,
            # and a gradient accumulated into an emptied parameter is copied to its (empty) shape. So the
            # release waits for the next fetch (or backward's end), which runs after them.
            self.deferred += released

    def _release_now(self, params: list[nn.Parameter]) -> None:
        for p in params:
            self._release(p)

    def _backward_end(self) -> None:
        deferred, self.deferred = self.deferred, []
        self._release_now(deferred)
        for m in list(self.backward_open.values()):  # DeepSpeed's release_backward_leftovers
            for p in self._direct(m):
                self.active[id(p)].discard(id(m))
                if self._partitioned(p):
                    self._release(p)
        self.backward_open.clear()
        self.running = False
        self.restore()


@contextmanager
def gathering(model: nn.Module, zero: Zero3, redirected: bool = False) -> Iterator[Gathering]:
    """ZeRO-3's gathered parameters played on ``model``'s steps while the context is open. ``redirected``: each
    step runs as a call of ``model`` (DeepSpeed's module), as Lightning runs ``training_step`` under DeepSpeed
    (``Strategy.training_step``'s forward redirection): a step that calls ``self(...)`` then calls the root twice,
    and DeepSpeed, resetting its trace at each, never completes one (no prefetch; each module's parameters
    released after it runs). Without: the step as a DeepSpeed engine's call runs it (``ckpt_tools/zero_ranks.py``)."""
    coordinator = Gathering(model, zero, redirected)
    linear = torch.nn.functional.linear
    if zero.memory_efficient_linear:  # DeepSpeed's own linear, as its engine installs it for the process (zero.Init)
        torch.nn.functional.linear = memory_efficient_linear()
    tracker = ModTracker()
    tracker.register_user_hooks(
        lambda m, _args: coordinator.fetch(m, forward=True),
        # ModTracker's post-forward hook is called even where the forward raised (always_call): DeepSpeed's is
        # not, and a checkpoint's recomputation stops early by raising, leaving its last module's parameters
        # gathered until their backward (a release there would empty a parameter whose gradient is still due).
        lambda m, _args, _out: sys.exc_info()[1] is None and coordinator.release(m, forward=True),
        lambda m, _grads: m is not None and coordinator.fetch(m, forward=False),
        lambda m, _grads: m is not None and coordinator.release(m, forward=False),
    )
    try:
        with tracker:
            yield coordinator
    finally:
        coordinator.restore()
        torch.nn.functional.linear = linear


__all__ = ["Gathering", "Zero3", "gathering", "persistent"]

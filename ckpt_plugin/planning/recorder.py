"""What one training step keeps for backward, and when: the recorder behind ``ckpt=auto``'s peak model.

The peak model itself (what ``kept``, ``running`` and ``rest_running`` are, and why
the peak is what it is) is written once, in ``planner.py``'s docstring.
:class:`Recorder` measures those numbers, in activation bytes as MemTracker counts
them (storages made by ops in forward, or by recomputation in backward), with the
layers in the order they first run. A layer's ``running`` bytes are the most
measured alive beyond the other layers' keeps, in its forward or recomputation
(its own keeps so far, its temporaries, its output, the rest of the model's keeps).
In backward, outside recomputation, autograd makes no activations and only frees
them, so no new maximum arises there. A layer's inputs count as kept by it under
every option (checkpointing holds them; without it a layer usually saves them),
so that no layer's numbers depend on a neighbour's option. Tests check that the
model bounds MemTracker's act peak on the GPT and the ResNet, within 5 %.

A step is recorded by ``steps.py``, which gives each layer a window
(:meth:`Recorder.window`) for as long as the step lasts.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import TorchDispatchMode, checkpoint_placeholder, is_fake, op_flops, tree_leaves
from ckpt_plugin.config.policy import BATCHED_MATMULS
from ckpt_plugin.engine.offload import OFFLOAD_MIN_BYTES, should_move
from ckpt_plugin.measure.memory import REST


class Recorder(TorchDispatchMode):
    """A timeline of one step: every storage the forward (or a recomputation) makes,
    when it is kept for backward and by whom, when it is freed, and a sample after
    every op, labelled with the layer running (or REST). Counts storages the way
    MemTracker's ``act`` does: made by ops outside backward, or by recomputation."""

    def __init__(self, model: nn.Module, fake: Any = None) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.sizes: dict[int, int] = {}  # uid -> bytes
        self.seen: dict[int, tuple[int | None, Any]] = {}  # id(storage) -> (uid or None, weakref)
        state = [*model.parameters(), *model.buffers()]
        state += [p.grad for p in model.parameters() if p.grad is not None]
        self.fake = fake
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real input) -> (it, its fake copy)
        if fake is not None:  # on fake tensors ops see the mode's (memoised) fake copy of each
            state += [fake.from_tensor(t) for t in state]
        self.state = state  # held: a storage id is only unique while its storage lives
        self.external = {id(t.untyped_storage()) for t in state}
        self.stack: list[str] = []
        self.counting = True
        self.batched = False  # whether a batched matmul (attention) ran inside a window: selective_nb differs then
        self.flops: dict[str, int] = defaultdict(int)  # recomputed, by layer
        self.forward_flops: dict[str, int] = defaultdict(int)  # of its forward, by layer
        self.counter: Recorder | None = None  # counts FLOPs (op_flops) when set: the recorder itself
        self.total_flops = 0
        self.backward_at: int | None = None  # the index of backward's first event (samples after: recomputation)
        self.phase_running: dict[tuple[str, str], int] = {}  # analyse(): (window, 'forward' or 'recompute') -> bytes
        self.backward_held = 0  # analyse(): bytes made after the layers' forward and alive, unkept, through backward
        self.late_alive = 0  # analyse(): the most made after the layers' forward (the loss, its targets) alive in a recomputation
        self.order: list[str] = []  # the layers in the order they first ran forward
        # uid (or ("outside", id) for a storage made before the step) -> (bytes, windows whose ops saved it), where
        # offload would copy it
        self.movable: dict[Any, tuple[int, set[str]]] = {}
        self.kept_owner: dict[int, str] = {}  # analyse(): uid -> the window its kept bytes count in
        # Windows inside windows (a layer's parts, inside.py): each call of a window runs in units, its own
        # ops before its first part, between two parts, after the last (unit j: after j parts), and each part.
        self.calls: dict[str, int] = defaultdict(int)  # window -> its calls in forward
        self.parts: dict[str, list[str]] = {}  # window -> the windows called directly inside its first call, in order
        self.unit: dict[str, tuple[int, int]] = {}  # window -> (j, event index where its unit j began), this call
        self.unit_start: dict[tuple[str, int], int] = {}  # (window, j) -> where unit j of its first call began
        self.ended: dict[str, int] = {}  # window -> event index where its first call ended (forward)
        self.unit_running: dict[tuple[str, int], int] = {}  # analyse(): (window, j) -> running bytes, see there
        self.unit_forward: dict[tuple[str, int], int] = {}  # analyse(): the same, in forward only
        self.unit_recompute: dict[tuple[str, int], int] = {}  # analyse(): the same, in recomputation only

    def _hold_fake_copy(self, t: torch.Tensor) -> None:
        """On fake tensors, keep the mode's copy of a real input (the batch) alive as long as
        the real one lives, as on real tensors: MemTracker, and we, count the batch's storage
        once an op views it (``targets.view(-1)``) and it must not die earlier on fake tensors."""
        if self.fake is not None and not is_fake(t) and id(t) not in self.held:
            self.held[id(t)] = (t, self.fake.from_tensor(t))

    def _uid(self, t: torch.Tensor, *, create: bool) -> int | None:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # tensors without storage (sparse, subclasses)
            return None
        key = id(st)
        if key in self.external:
            return None
        if key in self.seen:
            return self.seen[key][0]
        if not create:
            return None
        uid = len(self.sizes) if self.counting else None  # storages made in backward are not activations
        events = self.events

        def freed(_ref: Any, key: int = key, uid: int | None = uid) -> None:
            self.seen.pop(key, None)
            if uid is not None:
                events.append(("free", uid))

        self.seen[key] = (uid, weakref.ref(st, freed))
        if uid is not None:
            # As MemTracker: CUDA's caching allocator hands out multiples of 512 bytes.
            self.sizes[uid] = -(-st.nbytes() // 512) * 512 if st.device.type == "cuda" else st.nbytes()
            events.append(("alloc", uid))
        return uid

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._hold_fake_copy(t)
        out = func(*args, **(kwargs or {}))
        if self.stack and not self.batched:
            self.batched = func.overloadpacket.__name__ in BATCHED_MATMULS
        if self.counter is not None:
            self.total_flops += op_flops(func, args, kwargs or {}, out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._uid(t, create=True)
        if self.counting:
            window = self.stack[-1] if self.stack else REST
            j, start = self.unit.get(window, (0, 0)) if self.backward_at is None else (0, self.unit_start.get((window, 0), 0))
            self.events.append(("sample", window, j, start))
        return out

    def get_total_flops(self) -> int:
        """FLOPs of the ops run so far, as FlopCounterMode counts them (``op_flops``)."""
        return self.total_flops

    def keep(self, t: Any, owner: str | None = None) -> Any:
        """saved_tensors_hooks' pack: ``t`` is kept for backward by the layer running (``owner``: by that layer,
        which holds its inputs under every option, whether its ops save them or not)."""
        if isinstance(t, torch.Tensor) and not checkpoint_placeholder(t):  # torch 2.11's 0-byte one: not kept
            uid = self._uid(t, create=False)
            window = owner or (self.stack[-1] if self.stack else REST)
            if uid is not None:
                self.events.append(("pack", uid, window))
            if owner is None and should_move(t, OFFLOAD_MIN_BYTES):  # saved by an op: offload would copy it
                # Made before the step (the batch, a buffer): copied too, though the device keeps it anyway.
                key = uid if uid is not None else ("outside", id(t.untyped_storage()))
                self.movable.setdefault(key, (t.untyped_storage().nbytes(), set()))[1].add(window)
        return t

    def moves(self, kept_owner: dict[int, str]) -> tuple[dict[str, int], dict[str, int]]:
        """(device bytes offload would free, bytes its copies would carry) by layer, from the kept storages'
        owners (``analyse``). Copied: every storage an op of the layer saved that would move, once. Freed: of
        those, the ones the layer owns and no other window saved (a tensor two layers keep leaves the device only
        if both offload it: counted by neither, so the prediction errs high)."""
        freed: dict[str, int] = defaultdict(int)
        copied: dict[str, int] = defaultdict(int)
        packed_by: dict[int, set[str]] = defaultdict(set)
        for ev in self.events:
            if ev[0] == "pack":
                packed_by[ev[1]].add(ev[2])
        for uid, (nbytes, windows) in self.movable.items():
            for window in windows:
                copied[window] += nbytes
            owner = kept_owner.get(uid) if isinstance(uid, int) else None
            if owner is not None and windows == {owner} == packed_by[uid]:
                freed[owner] += self.sizes[uid]
        return dict(freed), dict(copied)

    def window(self, name: str, inner: Callable[..., Any], inputs: bool = True) -> Callable[..., Any]:
        """``inner`` (the layer's forward) labelled ``name`` in forward and in its recomputation.

        ``inputs``: count its inputs kept by it (see ``run``); False for a part left
        unwrapped, which keeps of its inputs only what its own ops save.
        """

        def run(*args: Any, **kwargs: Any) -> Any:
            recompute = not self.counting  # only backward stops counting; only recomputation runs forwards there
            outer = name not in self.stack  # in forward a wrapped layer runs in two windows (outside and inside its checkpoint)
            if not recompute:
                if name not in self.order:
                    self.order.append(name)
                # Checkpoint holds the inputs for recomputation; count them kept under every
                # option (without checkpointing a layer usually saves its input anyway), so that
                # what one layer keeps never depends on another's option.
                for t in tree_leaves((args, kwargs)) if inputs else ():
                    self.keep(t, name)
                if outer:
                    self._enter(name)
            # Counted in the outer window.
            counter = self.counter if recompute or outer else None
            before = counter.get_total_flops() if counter else 0
            self.stack.append(name)
            self.counting = True
            try:
                return inner(*args, **kwargs)
            finally:  # also when checkpoint stops a recomputation early (an exception)
                self.stack.pop()
                self.counting = not recompute
                if counter:
                    (self.flops if recompute else self.forward_flops)[name] += counter.get_total_flops() - before
                if outer and not recompute:
                    self._leave(name)

        run.__wrapped__ = inner  # type: ignore[attr-defined]  # the module it runs, for measure/values.py's keys
        return run

    def _enter(self, name: str) -> None:
        """A window's call begins (forward): its unit 0 begins, and it is a part of the window it runs in."""
        self.calls[name] += 1
        self.unit[name] = (0, len(self.events))
        self.unit_start.setdefault((name, 0), len(self.events))
        if self.calls[name] == 1:
            self.parts.setdefault(name, [])
            if self.stack:
                self.parts.setdefault(self.stack[-1], []).append(name)

    def _leave(self, name: str) -> None:
        """A window's call ends (forward): the next unit of the window it ran in begins."""
        self.ended.setdefault(name, len(self.events))
        if self.stack:
            outer = self.stack[-1]
            j = self.unit[outer][0] + 1
            self.unit[outer] = (j, len(self.events))
            self.unit_start.setdefault((outer, j), len(self.events))

    def analyse(self) -> tuple[dict[str, int], dict[str, int], int]:
        """(kept bytes by owner, running bytes by window, peak live bytes).

        A window's running bytes are the most alive at any moment while it runs
        (forward or recomputation) beyond what the *other* layers keep for
        backward by then: its own kept bytes so far, its temporaries, its
        output, and the rest of the model's. Nothing in it depends on another
        layer's option, and while layer ``i`` runs the others keep exactly the
        layers before it (those after it have not run, or in backward have
        already freed theirs), so ``kept[1..i-1] + running[i]`` is what is alive
        then. A tensor that two layers keep (a block that saves its output, the
        next one's input) belongs to the later one, which keeps it whatever its
        option: counted once, whatever the earlier one's option.

        Windows inside windows (``inside.py``) need more: ``unit_running``, by
        unit of each window (``Recorder.window``), is the most alive beyond
        what the windows that *ended before the unit began* keep, in forward
        and in recomputation (``unit_forward``, ``unit_recompute``: in either). A layer's parts
        keep what they keep for as long as their layer is running, while a part
        that runs later may keep something already alive (the layer's input
        its shortcut keeps): alive, so counted, until that part has run.
        """
        owners: dict[int, set[str]] = defaultdict(set)
        for ev in self.events:
            if ev[0] == "pack":
                owners[ev[1]].add(ev[2])
        kept_by: dict[str, int] = defaultdict(int)
        rank = {name: i for i, name in enumerate(self.order)}
        for uid, names in owners.items():
            # Kept by the rest too (the stem's output, also the first layer's input): alive as long
            # as the rest keeps it, whatever the layer's option, so counted once, in the rest. Kept by
            # two layers (a block that saves its output, the next one's input): counted once, in the
            # later one, which keeps its input under every option.
            # Kept by a layer's own ops and by a part of it (a ReLU's input, a matmul output a selective
            # part saves too): the layer keeps it whatever the part's option, so it is the layer's.
            names = {n for n in names if not any(n.startswith(a + ".") for a in names)}
            owner = REST if REST in names else max(names, key=lambda n: rank.get(n, len(rank)))
            kept_by[owner] += self.sizes[uid]
            owners[uid] = {owner}
        frozen = {uid: next(iter(names)) for uid, names in owners.items()}
        self.kept_owner = frozen
        live = peak = 0
        kept_alive: dict[str, int] = defaultdict(int)  # packed and alive, by its owner
        packed: set[int] = set()
        running: dict[str, int] = defaultdict(int)
        made_at: dict[int, int] = {}  # alive uid -> index of its allocation
        layers_end = max((i for i, ev in enumerate(self.events[:self.backward_at])
                          if ev[0] == "sample" and ev[1] != REST), default=-1)
        backward_at = len(self.events) if self.backward_at is None else self.backward_at
        late = 0  # alive, made after the layers' forward and before backward
        for index, (kind, *rest) in enumerate(self.events):
            if index == self.backward_at:  # made after the layers, alive through backward, kept by none: the loss
                self.backward_held = sum(self.sizes[u] for u, at in made_at.items()
                                         if at > layers_end and u not in packed)
            if kind == "sample":
                window, j, start = rest
                others = sum(v for who, v in kept_alive.items() if who != REST and who != window)
                running[window] = max(running[window], live - others)
                forward = self.backward_at is None or index < self.backward_at
                phase = (window, "forward" if forward else "recompute")
                self.phase_running[phase] = max(self.phase_running.get(phase, 0), live - others)
                start = index if window == REST else start
                before = live - sum(v for who, v in kept_alive.items() if self.ended.get(who, index + 1) <= start)
                self.unit_running[window, j] = max(self.unit_running.get((window, j), 0), before)
                phases = self.unit_forward if forward else self.unit_recompute
                phases[window, j] = max(phases.get((window, j), 0), before)
                if not forward and window != REST:
                    self.late_alive = max(self.late_alive, late)
                peak = max(peak, live)
                continue
            uid = rest[0]
            size = self.sizes[uid]
            if kind == "alloc":
                live += size
                made_at[uid] = index
                late += size if layers_end < index < backward_at else 0
            elif kind == "pack" and uid not in packed:
                packed.add(uid)
                kept_alive[frozen[uid]] += size
            elif kind == "free":
                live -= size
                late -= size if layers_end < made_at.get(uid, -1) < backward_at else 0
                made_at.pop(uid, None)
                if uid in packed:
                    kept_alive[frozen[uid]] -= size
        return dict(kept_by), dict(running), peak


__all__ = ["Recorder"]

"""``ckpt=auto``: choose per layer what to checkpoint so that activations fit a budget.

    python recipes/train.py ckpt=auto ckpt.layers=TransformerBlock ckpt.budget=0.4
    python recipes/train.py ckpt=auto ckpt.layers=TransformerBlock ckpt.budget=2GiB

Each candidate layer gets one of three options: ``keep`` (no checkpointing),
``selective`` (the ``matmuls`` policy) or ``full``. :func:`profile` measures,
on fake tensors (``measure/fake.py``: exact bytes and FLOPs, no memory, so
profiling never needs the step the user turned checkpointing on to avoid),
with every candidate wrapped with one option at a time, what each layer keeps
for backward, the FLOPs its recomputation adds, and what is alive while it
runs. ``planning/timing.py`` adds what each option costs in step time,
measured on real tensors one layer at a time. :func:`plan` (``planner.py``)
then picks the options with the least added step time (FLOPs without a
timing) whose predicted activation peak fits, exactly: a dynamic programme,
no ILP solver (torch's ``_tools/sac_ilp.py`` needs pulp) and no
``torch.compile`` (torchtitan's ``MemoryBudgetAC`` needs it).

The peak model (``planner.py``), in activation bytes as MemTracker counts them
(storages made by ops in forward, or by recomputation in backward), with the
layers in the order they first run::

    peak = max(max_i(kept[1] + ... + kept[i-1] + running[i]), kept[1] + ... + kept[L] + rest_running)

At any moment of a step the live activations split in two: those the layers
other than the one running keep for backward, and everything else. While
layer ``i`` runs forward, the layers before it have run and keep all they
keep; those after it have not run. While it recomputes in backward, the
layers after it have run their backward and freed what they kept. So the
others keep exactly ``kept[1..i-1]``, and the rest is layer ``i``'s
``running`` bytes: the most measured alive beyond the other layers' keeps, in
its forward or recomputation (its own keeps so far, its temporaries, its
output, the rest of the model's keeps). Outside the layers (embedding, head,
loss) every layer keeps all it keeps, plus the rest's running bytes. In
backward, outside recomputation, autograd makes no activations and only frees
them, so no new maximum arises there. A layer's inputs count as kept by it
under every option (checkpointing holds them; without it a layer usually
saves them), so that no layer's numbers depend on a neighbour's option. The
model assumes backward visits the layers in reverse order (a chain of blocks,
as in every example and the models it is meant for); it is exact for such a
chain except that a tensor two layers keep counts twice, and tests check it
bounds MemTracker's act peak on the GPT and the ResNet, within 5 %.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin._compat import TorchDispatchMode, is_fake, tree_leaves
from ckpt_plugin.planning.budget import Budget, parse_budget, resolve
from ckpt_plugin.measure.fake import fake_measurement
from ckpt_plugin.measure.memory import REST, side_effect_free
from ckpt_plugin.planning.timing import LayerTimes, check_candidates, measure_layer_times
from ckpt_plugin.planning.planner import OPTIONS, Cost, LayerProfile, Plan, Profile, plan
from ckpt_plugin.engine.policies import make_policy
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.plan import EachLayer, WrapPlan
from ckpt_plugin.engine.wrap import CheckpointedForward, checkpointing_disabled

# ---------------------------------------------------------------------- profiling

def treatment(option: str, preserve_rng_state: bool = True) -> Treatment | None:
    """How a layer runs under ``option``: None for ``keep`` (leave it unwrapped)."""
    if option == "keep":
        return None
    policy = make_policy("matmuls") if option == "selective" else None
    return Treatment(checkpointing=True, preserve_rng_state=preserve_rng_state, policy=policy)


class _Recorder(TorchDispatchMode):
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
        self.flops: dict[str, int] = defaultdict(int)
        self.counter: FlopCounterMode | None = None
        self.order: list[str] = []  # the layers in the order they first ran forward

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
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._uid(t, create=True)
        if self.counting:
            self.events.append(("sample", self.stack[-1] if self.stack else REST))
        return out

    def keep(self, t: Any, owner: str | None = None) -> Any:
        """saved_tensors_hooks' pack: ``t`` is kept for backward by the layer running."""
        if isinstance(t, torch.Tensor):
            uid = self._uid(t, create=False)
            if uid is not None:
                self.events.append(("pack", uid, owner or (self.stack[-1] if self.stack else REST)))
        return t

    def window(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``inner`` (the layer's forward) labelled ``name`` in forward and in its recomputation."""

        def run(*args: Any, **kwargs: Any) -> Any:
            recompute = not self.counting  # only backward stops counting; only recomputation runs forwards there
            if not recompute:
                if name not in self.order:
                    self.order.append(name)
                # Checkpoint holds the inputs for recomputation; count them kept under every
                # option (without checkpointing a layer usually saves its input anyway), so that
                # what one layer keeps never depends on another's option.
                for t in tree_leaves((args, kwargs)):
                    self.keep(t, name)
            counter = self.counter if recompute else None
            before = counter.get_total_flops() if counter else 0
            self.stack.append(name)
            self.counting = True
            try:
                return inner(*args, **kwargs)
            finally:  # also when checkpoint stops a recomputation early (an exception)
                self.stack.pop()
                self.counting = not recompute
                if counter:
                    self.flops[name] += counter.get_total_flops() - before

        return run

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
            owner = REST if REST in names else max(names, key=lambda n: rank.get(n, len(rank)))
            kept_by[owner] += self.sizes[uid]
            owners[uid] = {owner}
        frozen = {uid: frozenset(names) for uid, names in owners.items()}
        live = peak = 0
        kept_alive: dict[frozenset, int] = defaultdict(int)  # packed and alive, by the set of its owners
        packed: set[int] = set()
        running: dict[str, int] = defaultdict(int)
        for kind, *rest in self.events:
            if kind == "sample":
                window = rest[0]
                others = sum(v for who, v in kept_alive.items() if REST not in who and window not in who)
                running[window] = max(running[window], live - others)
                peak = max(peak, live)
                continue
            uid = rest[0]
            size = self.sizes[uid]
            if kind == "alloc":
                live += size
            elif kind == "pack" and uid not in packed:
                packed.add(uid)
                kept_alive[frozen[uid]] += size
            elif kind == "free":
                live -= size
                if uid in packed:
                    kept_alive[frozen[uid]] -= size
        return dict(kept_by), dict(running), peak


def _step(model: nn.Module, names: list[str], forward: Callable[[], Any], option: str, *, flops: bool,
          fake: Any = None) -> _Recorder:
    """One training step with every candidate under ``option``, recorded; the model is left as it was.

    Memory (``flops=False``) and FLOPs (``flops=True``) come from separate steps:
    FlopCounterMode's module tracker holds recomputed tensors until backward ends
    (multi-grad hooks on module outputs), which would distort the memory timeline.
    """
    modules = dict(model.named_modules())
    how = treatment(option) or Treatment(checkpointing=False)
    recorder = _Recorder(model, fake)
    mode = FlopCounterMode(display=False) if flops else recorder
    recorder.counter = mode if flops else None
    previous = {name: modules[name].__dict__.get("forward") for name in names}
    grads = {p: p.grad for p in model.parameters()}
    try:
        for name in names:
            module = modules[name]
            # Labelled inside checkpoint (its recomputation runs the inner forward only) and
            # outside it (checkpoint saves the layer's inputs before calling the inner forward).
            module.__dict__["forward"] = recorder.window(name, module.forward)
            module.__dict__["forward"] = recorder.window(name, CheckpointedForward(module, how, name))
        with side_effect_free(model), fake or contextlib.nullcontext(), mode, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(recorder.keep, lambda t: t):
                outputs = [t for t in tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outputs:
                    raise ValueError("ckpt=auto: the profiling forward returned no tensor that requires grad; "
                                     "it must return the loss")
                # Made before backward, as loss.backward() makes its own: MemTracker counts it as act.
                seeds = [torch.ones_like(t) for t in outputs]
            recorder.counting = False
            torch.autograd.backward(outputs, seeds)
            del outputs, seeds
    finally:
        for p, g in grads.items():  # the step's gradients are dropped
            p.grad = g
        for name in names:
            if previous[name] is None:
                modules[name].__dict__.pop("forward", None)
            else:
                modules[name].__dict__["forward"] = previous[name]
    return recorder


def profile(model: nn.Module, names: list[str], forward: Callable[[], Any], *, fake: bool = True,
            timed: bool = False) -> Profile:
    """Measure every option of every candidate layer (qualified names) on fake tensors.

    ``forward()`` runs the model on a sample batch and returns the loss. Five
    steps in all, each with every candidate wrapped one way: three record memory
    (keep, selective, full), two count recompute FLOPs (selective, full). They
    run on fake tensors (``measure/fake.py``): bytes and FLOPs are the real
    ones and no activation is allocated, whatever the batch; ``fake=False``
    runs them on real tensors (for tests that compare the two). ``timed=True``
    also measures what each option adds to the step time (``timing.py``: real
    tensors, one layer at a time, never the un-checkpointed step), which the
    planner then minimises. They leave no trace: RNG streams, buffers,
    gradients and wrapping are restored.
    """
    names = list(dict.fromkeys(names))
    check_candidates(model, names)
    silenced = cache_warnings_silenced()  # its wrappers are for a moment: the installation warns, once
    with silenced, checkpointing_disabled(model), fake_measurement(model, "ckpt=auto's profile") as mode:
        mode = mode if fake else None
        recorders = {option: _step(model, names, forward, option, flops=False, fake=mode) for option in OPTIONS}
        memory = {option: recorder.analyse() for option, recorder in recorders.items()}
        flops = {option: _step(model, names, forward, option, flops=True, fake=mode).flops if option != "keep" else {}
                 for option in OPTIONS}
    layers = [
        LayerProfile(name, {
            option: Cost(kept.get(name, 0), flops[option].get(name, 0), running.get(name, 0))
            for option, (kept, running, _peak) in memory.items()
        })
        for name in names
    ]
    # The planner's peak model follows the order the layers run in; layers that never ran go last.
    ran = recorders["keep"].order
    layers.sort(key=lambda layer: ran.index(layer.name) if layer.name in ran else len(ran))
    measured = Profile(
        layers=layers,
        rest_bytes=max(kept.get(REST, 0) for kept, _, _ in memory.values()),
        rest_running=max(running.get(REST, 0) for _, running, _ in memory.values()),
        no_ckpt_peak=memory["keep"][2],
    )
    if not timed:
        return measured
    with cache_warnings_silenced():
        times = measure_layer_times(model, names, forward, {o: treatment(o) for o in OPTIONS})
    return with_times(measured, times)


def with_times(measured: Profile, times: LayerTimes) -> Profile:
    """``measured`` with each option's added step time from ``times`` (negative noise read as 0)."""
    layers = [LayerProfile(layer.name, {o: replace(c, seconds=max(times.added(layer.name, o), 0.0))
                                        for o, c in layer.options.items()})
              for layer in measured.layers]
    return replace(measured, layers=layers, none_seconds=times.predicted_none_seconds)


def wrap_plan(chosen: Plan, preserve_rng_state: bool = True) -> WrapPlan:
    """``chosen`` as a plan the engine installs: each layer with its option (``keep`` stays unwrapped).

    The planner decides and never installs; the names keep ``chosen``'s order.
    """
    how = {option: treatment(option, preserve_rng_state) for option in OPTIONS}
    groups = tuple(EachLayer((name,), how[option]) for name, option in chosen.choices.items() if how[option] is not None)
    return WrapPlan(groups, summary=f"ckpt=auto plan:\n{chosen}", planned=chosen)


__all__ = [
    "Budget",
    "Cost",
    "LayerProfile",
    "OPTIONS",
    "Plan",
    "Profile",
    "with_times",
    "wrap_plan",
    "parse_budget",
    "plan",
    "profile",
    "resolve",
    "treatment",
]

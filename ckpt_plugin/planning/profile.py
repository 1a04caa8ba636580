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
``torch.compile`` (torchtitan's ``MemoryBudgetAC`` needs it). With ``depth``
(``ckpt=auto``: ``INSIDE_DEPTH``), the layers' parts (child modules, and
theirs) are measured and timed the same way, level by level, and become more
options of their layer (``inside.py``): checkpointed inside it, so that a
budget under what ``full`` on a layer reaches can be met. A layer that cannot
run under a selective option (its caller writes in place into an output the
policy saved: ``policies.SavedOutputModified``) is profiled, timed and planned
without it.

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
import logging
import weakref
from dataclasses import dataclass, field, replace
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import TorchDispatchMode, checkpoint_placeholder, is_fake, op_flops, tree_leaves
from ckpt_plugin.config.budget import Budget, parse_budget, resolve
from ckpt_plugin.measure.fake import fake_measurement
from ckpt_plugin.measure.memory import REST, side_effect_free
from ckpt_plugin.planning.timing import LayerTimes, TimingCache, check_candidates, measure_layer_times
from ckpt_plugin.planning.planner import INSIDE, OPTIONS, PART_OPTIONS, POLICY_OF, Cost, LayerProfile, Plan, Profile, plan
from ckpt_plugin.planning.inside import Chain, with_inside
from ckpt_plugin.planning.rotor import ChainCosts
from ckpt_plugin.engine.blocks import has_forward
from ckpt_plugin.engine.op_groups import is_regrouped, regroup, top_groups, ungroup
from ckpt_plugin.engine.op_groups import parts as op_group_parts
from ckpt_plugin.engine.policies import BATCHED_MATMULS, SavedOutputModified, make_policy
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.plan import EachLayer, WrapPlan
from ckpt_plugin.engine.wrap import CheckpointedForward, checkpointing_disabled

log = logging.getLogger("ckpt_plugin")

# ---------------------------------------------------------------------- profiling

def treatment(option: str, preserve_rng_state: bool = True) -> Treatment | None:
    """How a layer runs under ``option``: None for ``keep`` (leave it unwrapped)."""
    if option == "keep":
        return None
    policy = make_policy(POLICY_OF[option]) if option in POLICY_OF else None
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
        self.batched = False  # whether a batched matmul (attention) ran inside a window: selective_nb differs then
        self.flops: dict[str, int] = defaultdict(int)  # recomputed, by layer
        self.forward_flops: dict[str, int] = defaultdict(int)  # of its forward, by layer
        self.counter: _Recorder | None = None  # counts FLOPs (op_flops) when set: the recorder itself
        self.total_flops = 0
        self.backward_at: int | None = None  # the index of backward's first event (samples after: recomputation)
        self.phase_running: dict[tuple[str, str], int] = {}  # analyse(): (window, 'forward' or 'recompute') -> bytes
        self.backward_held = 0  # analyse(): bytes made after the layers' forward and alive, unkept, through backward
        self.late_alive = 0  # analyse(): the most made after the layers' forward (the loss, its targets) alive in a recomputation
        self.order: list[str] = []  # the layers in the order they first ran forward
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
        """saved_tensors_hooks' pack: ``t`` is kept for backward by the layer running."""
        if isinstance(t, torch.Tensor) and not checkpoint_placeholder(t):  # torch 2.11's 0-byte one: not kept
            uid = self._uid(t, create=False)
            if uid is not None:
                self.events.append(("pack", uid, owner or (self.stack[-1] if self.stack else REST)))
        return t

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
        unit of each window (``_Recorder.window``), is the most alive beyond
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


def _step(model: nn.Module, names: list[str], forward: Callable[[], Any], option: str | Mapping[str, str], *,
          fake: Any = None, around: list[str] = ()) -> _Recorder:
    """One training step with every candidate under ``option``, recorded; the model is left as it was.

    ``option`` may map each name to its own (a plan's choices: nested names are
    nested checkpoints; ``inside`` leaves the module unwrapped, as ``keep``).

    Memory and FLOPs come from the same step: the recorder counts each op's FLOPs
    as FlopCounterMode does (``_compat.op_flops``, its registry), not through
    FlopCounterMode itself, whose module tracker holds recomputed tensors until
    backward ends (multi-grad hooks on module outputs) and would distort the
    memory timeline. ``around``: modules recorded as windows too, unwrapped (the
    layers that ``names``, their parts, sit in; ``inside.py``).
    """
    modules = dict(model.named_modules())
    chosen = dict.fromkeys(names, option) if isinstance(option, str) else option
    how = {o: (treatment(o) if o != INSIDE else None) or Treatment(checkpointing=False) for o in set(chosen.values())}
    recorder = _Recorder(model, fake)
    recorder.counter = mode = recorder
    previous = {name: modules[name].__dict__.get("forward") for name in [*around, *names]}
    grads = {p: p.grad for p in model.parameters()}
    try:
        for name in around:
            modules[name].__dict__["forward"] = recorder.window(name, modules[name].forward)
        for name in names:
            module = modules[name]
            # Labelled inside checkpoint (its recomputation runs the inner forward only) and
            # outside it (checkpoint saves the layer's inputs before calling the inner forward).
            # A part (``around`` given) left unwrapped keeps of its inputs what its ops save: with the
            # rule above for its layer's inputs, a tensor is never counted less than it is kept.
            inputs = not around or how[chosen[name]].checkpointing
            module.__dict__["forward"] = recorder.window(name, module.forward, inputs)
            module.__dict__["forward"] = recorder.window(name, CheckpointedForward(module, how[chosen[name]], name),
                                                         inputs)
        with side_effect_free(model), fake or contextlib.nullcontext(), mode, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(recorder.keep, lambda t: t):
                outputs = [t for t in tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outputs:
                    raise ValueError("ckpt=auto: the profiling forward returned no tensor that requires grad; "
                                     "it must return the loss")
                # Made before backward, as loss.backward() makes its own: MemTracker counts it as act.
                seeds = [torch.ones_like(t) for t in outputs]
            recorder.counting = False
            recorder.backward_at = len(recorder.events)
            torch.autograd.backward(outputs, seeds)
            del outputs, seeds
    finally:
        for p, g in grads.items():  # the step's gradients are dropped
            p.grad = g
        for name, before in previous.items():
            if before is None:
                modules[name].__dict__.pop("forward", None)
            else:
                modules[name].__dict__["forward"] = before
    return recorder


@dataclass
class ProfileCache:
    """What :func:`profile` measured of one model, kept by the caller to profile it again deeper.

    ``ckpt=auto`` profiles the layers, and only after a refusal their parts too:
    the second profile reads back the layers' steps (by the candidates' names)
    and timings instead of running them again.
    """

    timings: TimingCache = field(default_factory=dict)
    # (names, fake) -> (recorder by option, FLOPs by option and layer, options by layer it cannot run under)
    steps: dict[tuple[tuple[str, ...], bool], tuple[dict[str, _Recorder], dict[str, dict[str, int]],
                                                    dict[str, set[str]]]] = field(default_factory=dict)


def profile(model: nn.Module, names: list[str], forward: Callable[[], Any], *, fake: bool = True,
            timed: bool = False, compiled: Mapping[str, str] | None = None, depth: int = 0,
            cache: ProfileCache | None = None) -> Profile:
    """Measure every option of every candidate layer (qualified names) on fake tensors.

    ``forward()`` runs the model on a sample batch and returns the loss. Three
    steps in all, each with every candidate wrapped one way (keep, selective,
    full), each recording memory and counting FLOPs (recomputed ones included). They
    run on fake tensors (``measure/fake.py``): bytes and FLOPs are the real
    ones and no activation is allocated, whatever the batch; ``fake=False``
    runs them on real tensors (for tests that compare the two). ``timed=True``
    also measures what each option adds to the step time (``timing.py``: real
    tensors, one layer at a time, never the un-checkpointed step), which the
    planner then minimises; ``compiled`` (option -> backend) times those options
    compiled, as the step will run them (``measure_layer_times``). They leave no trace: RNG streams, buffers,
    gradients and wrapping are restored.

    ``depth``: how many levels of parts (child modules) below each layer are
    candidates too (``inside.py``; ``ckpt=auto`` asks for ``INSIDE_DEPTH``).
    Each level costs three more steps, every part of that level under one
    option at a time, and its parts are timed as the layers are (alike parts
    once); their options reach a layer as options inside it. ``cache``: a
    :class:`ProfileCache` the caller keeps, so that profiling the same model
    again (deeper) neither steps nor times its layers again.
    """
    names = list(dict.fromkeys(names))
    check_candidates(model, names)
    with checkpointing_disabled(model), contextlib.ExitStack() as stack:
        return _profile(model, names, forward, fake=fake, timed=timed, compiled=compiled, depth=depth,
                        cache=ProfileCache() if cache is None else cache, stack=stack)


def _profile(model: nn.Module, names: list[str], forward: Callable[[], Any], *, fake: bool, timed: bool,
             compiled: Mapping[str, str] | None, depth: int, cache: ProfileCache,
             stack: contextlib.ExitStack) -> Profile:
    """:func:`profile`, with the layers unwrapped. The layers are stepped as they are; for their parts
    (``depth``), those with op groups run regrouped (``op_groups.py``) until ``stack`` closes."""
    silenced = cache_warnings_silenced()  # its wrappers are for a moment: the installation warns, once
    grouped: tuple[str, ...] = ()
    with silenced, fake_measurement(model, "ckpt=auto's profile") as mode:
        mode = mode if fake else None
        if (tuple(names), fake) not in cache.steps:
            stepped = {"keep": _step(model, names, forward, "keep", fake=mode)}
            # Without a batched matmul in the layers, selective_nb saves what selective saves (linear layers
            # only) or what full does (convolutions): no option of its own, so no step of its own either.
            offered = [o for o in OPTIONS if o != "selective_nb" or stepped["keep"].batched]
            lacking: dict[str, set[str]] = {}  # layer -> options it cannot run under
            for option in offered[1:]:
                stepped[option], without = _step_where_it_runs(model, names, forward, option, mode)
                for name in without:
                    lacking.setdefault(name, set()).add(option)
            cache.steps[tuple(names), fake] = (
                stepped, {option: dict(r.flops) if option != "keep" else {} for option, r in stepped.items()}, lacking)
        recorders, flops, lacking = cache.steps[tuple(names), fake]
        memory = {option: recorder.analyse() for option, recorder in recorders.items()}
        forward_running = {name: recorders["full"].unit_forward.get((name, 0), 0) for name in names}
        grouped = _ran_as_groups(model, names, forward, mode, stack.enter_context(_grouped(model, names))) \
            if depth else ()
        if grouped:  # a full layer with parts inside it runs regrouped: a traced forward may free sooner
            full = _step(model, names, forward, "full", fake=mode)
            forward_running |= {name: full.unit_forward.get((name, 0), 0) for name in grouped}
        parts, chains = _measure_parts(model, names, forward, mode, depth, forward_running)
    layers = [
        LayerProfile(name, {
            option: Cost(kept.get(name, 0), flops[option].get(name, 0), running.get(name, 0))
            for option, (kept, running, _peak) in memory.items() if option not in lacking.get(name, ())
        })
        for name in names
    ]
    layers = _useful_options(layers)
    # The planner's peak model follows the order the layers run in; layers that never ran go last.
    ran = recorders["keep"].order
    layers.sort(key=lambda layer: ran.index(layer.name) if layer.name in ran else len(ran))
    measured = Profile(
        layers=layers,
        rest_bytes=max(kept.get(REST, 0) for kept, _, _ in memory.values()),
        rest_running=max(running.get(REST, 0) for _, running, _ in memory.values()),
        no_ckpt_peak=memory["keep"][2],
        parts=parts,
        chains=chains,
        # A plan's own step on fake tensors: eager only (a compiled step keeps what its partitioner chooses).
        measure=(lambda chosen: _plan_peak(model, forward, chosen.choices, fake, grouped)) if chains or not compiled
        else None,
        regrouped=grouped,
    )
    if not timed:
        return _with_inside(measured)
    timed_parts = {name: list(options) for name, options in parts.items() if len(options) > 1}
    measured_options = [*(layer.options for layer in measured.layers), *parts.values()]
    offered = [o for o in OPTIONS if any(o in options for options in measured_options)]
    with cache_warnings_silenced():
        times = measure_layer_times(model, names, forward, {o: treatment(o) for o in offered},
                                    compiled={o: b for o, b in (compiled or {}).items() if o in offered},
                                    parts=timed_parts, cache=cache.timings, whole_step="keep" in (compiled or {}),
                                    layer_options={layer.name: list(layer.options) for layer in measured.layers})
    return with_times(measured, times)


def _useful_options(layers: list[LayerProfile]) -> list[LayerProfile]:
    """``layers`` without ``selective_nb`` where it is no option of its own: on no layer does it keep less than
    ``selective`` and more than ``full`` (a ResNet's blocks have no matmul it saves, so it would keep what
    ``full`` keeps, recomputing as much, through a policy). Then it is neither timed nor planned with."""

    def between(layer: LayerProfile) -> bool:
        o = layer.options
        if "selective_nb" in o and "selective" not in o:  # selective cannot run here: selective_nb is the one
            return True
        return "selective_nb" in o and o["full"].kept_bytes < o["selective_nb"].kept_bytes < o["selective"].kept_bytes

    if all("selective_nb" not in layer.options for layer in layers) or any(between(layer) for layer in layers):
        return layers
    return [replace(layer, options={o: c for o, c in layer.options.items() if o != "selective_nb"}) for layer in layers]


INSIDE_DEPTH = 2  # ckpt=auto: a layer's children and their children are candidates too


def parts_of(model: nn.Module, name: str) -> list[str]:
    """The modules the forward of ``name`` may call directly: its children, a ModuleList's items in its place;
    for a module regrouped (``op_groups.py``), its op groups and the children it calls outside them."""
    grouped = op_group_parts(model.get_submodule(name))
    if grouped is not None:
        return [f"{name}.{part}" if name else part for part in grouped]
    found = []
    for child, module in model.get_submodule(name).named_children():
        qualified = f"{name}.{child}" if name else child
        found += [qualified] if has_forward(module) else parts_of(model, qualified)
    return found


def _measure_parts(model: nn.Module, names: list[str], forward: Callable[[], Any], mode: Any, depth: int,
                   forward_running: dict[str, int]) -> tuple[dict[str, dict[str, Cost]], dict[str, Chain]]:
    """Each level of parts below ``names``, as :func:`profile` measures the layers: their options and chains.

    Three steps per level, every part of the level under one option, the levels
    above recorded as windows, unwrapped. A module gets a chain (``inside.Chain``)
    when it ran once and each of its parts ran once in it. A part's option that
    keeps no less and runs no lighter than ``keep`` is dropped (never worth a
    timing). A level whose parts cannot be checkpointed (the step fails) ends the
    descent: the layers keep the options measured above it.
    """
    parts: dict[str, dict[str, Cost]] = {}
    chains: dict[str, Chain] = {}
    levels = [list(names)]
    for _ in range(depth):
        level = [part for name in levels[-1] for part in parts_of(model, name)]
        if not level:
            break
        around = [name for above in levels for name in above]
        try:
            keep = _step(model, level, forward, "keep", fake=mode, around=around)
            twice = {part for part in level if keep.calls[part] > 1}
            if twice:  # a part called twice (a shared drop-path) is no candidate: its calls are its layer's own ops
                level = [part for part in level if part not in twice]
                keep = _step(model, level, forward, "keep", fake=mode, around=around) if level else None
            steps = _parts_steps(model, level, forward, mode, around, keep) if level else {}
        except Exception as err:  # noqa: BLE001 -- parts are an extra: the layers' own options stand
            log.debug("ckpt=auto: no candidates inside %s: checkpointing its parts fails (%s: %s)",
                      ", ".join(levels[-1][:3]), type(err).__name__, err)
            break
        if not level:
            break
        recorders, flops = {o: r for o, (r, _, _) in steps.items()}, {o: f for o, (_, f, _) in steps.items()}
        lacking = {o: parts_out for o, (_, _, parts_out) in steps.items()}  # option -> parts that cannot run it
        kept = {o: r.analyse()[0] for o, r in recorders.items()}
        keep = recorders["keep"]
        held = max(r.late_alive for r in recorders.values())  # the loss: alive in backward, where a recomputation runs
        for name in levels[-1]:
            inner = keep.parts.get(name) or []
            once = all(r.calls[n] == 1 and r.parts.get(name) == inner for r in recorders.values() for n in [name, *inner])
            if not inner or not once or name not in forward_running:
                continue
            glue = tuple(max(r.unit_running.get((name, j), 0) for r in recorders.values()) for j in range(len(inner) + 1))
            chains[name] = Chain(tuple(inner), max(k.get(name, 0) for k in kept.values()), glue, forward_running[name],
                                 held)
            for part in inner:
                options = {o: Cost(kept[o].get(part, 0), flops[o].get(part, 0), r.unit_running.get((part, 0), 0),
                                   backward_running=max(r.unit_forward.get((part, 0), 0) + held,
                                                        r.unit_recompute.get((part, 0), 0)))
                           for o, r in recorders.items()}
                plain = options["keep"]
                parts[part] = {o: c for o, c in options.items() if o == "keep" or part not in lacking[o] and (
                               c.kept_bytes < plain.kept_bytes or c.running_bytes < plain.running_bytes)}
                forward_running[part] = recorders["full"].unit_forward.get((part, 0), 0)
        levels.append([part for part in level if part in parts])
    return parts, chains


@contextlib.contextmanager
def _grouped(model: nn.Module, names: Iterable[str]) -> Iterator[tuple[str, ...]]:
    """The layers ``names`` regrouped (``op_groups.py``) for as long as it lasts; yields those that have groups."""
    modules = dict(model.named_modules())
    added = [n for n in names if not is_regrouped(modules[n]) and regroup(modules[n])]
    try:
        yield tuple(n for n in names if is_regrouped(modules[n]))
    finally:
        for name in added:
            ungroup(modules[name])


def _ran_as_groups(model: nn.Module, names: list[str], forward: Callable[[], Any], mode: Any,
                   grouped: tuple[str, ...]) -> tuple[str, ...]:
    """Those of the ``grouped`` layers whose op groups ran in a step; the others are ungrouped again.

    A traced forward runs only for calls like the traced one (``op_groups.TracedForward``):
    a layer called with keywords (a Hugging Face layer's ``attention_mask=``) runs its own
    forward, so its parts are its child modules, as without groups."""
    if not grouped:
        return grouped
    modules = dict(model.named_modules())
    tops = {layer: [f"{layer}.{g}" for g in top_groups(modules[layer])] for layer in grouped}
    recorder = _step(model, [g for gs in tops.values() for g in gs], forward, "keep", fake=mode, around=names)
    unused = [layer for layer, gs in tops.items() if not all(recorder.calls[g] for g in gs)]
    for layer in unused:
        ungroup(modules[layer])
    return tuple(layer for layer in grouped if layer not in unused)


def _plan_peak(model: nn.Module, forward: Callable[[], Any], choices: Mapping[str, str], fake: bool,
               grouped: tuple[str, ...] = ()) -> int:
    """The activation peak of one step with ``choices`` on (a plan's: nested names nest), measured as profiled."""
    with (cache_warnings_silenced(), checkpointing_disabled(model), _grouped(model, _regrouped(grouped, choices)),
          fake_measurement(model, "ckpt=auto's profile") as mode):
        return _step(model, list(choices), forward, dict(choices), fake=mode if fake else None).analyse()[2]


def _step_where_it_runs(model: nn.Module, names: list[str], forward: Callable[[], Any], option: str,
                        mode: Any, around: list[str] = ()) -> tuple[_Recorder, set[str]]:
    """:func:`_step` with every candidate under ``option`` that can run under it; the others, kept.

    A selective policy cannot run where an output it saves is written in place after the
    layer returned it (``policies.SavedOutputModified``: a parent's ``x.mul_(scale)`` on a
    layer ending in a linear; writes inside the layer are copied before, ``policies.py``):
    the step names the first such layer, and every candidate of its class runs ``keep`` in
    a step again (one class runs one forward). Returns the recorder and the layers left out.
    ``around``: as for :func:`_step` (the candidates are parts of layers).
    """
    modules = dict(model.named_modules())
    chosen = dict.fromkeys(names, option)
    while True:
        try:
            return (_step(model, names, forward, chosen, fake=mode, around=around),
                    {n for n, o in chosen.items() if o != option})
        except SavedOutputModified as err:
            if err.module not in chosen or chosen[err.module] != option:
                raise
            cls = type(modules[err.module])
            chosen |= {n: "keep" for n in names if type(modules[n]) is cls}
            log.debug("ckpt=auto: no %s for %s layers: %s", option, cls.__name__, err)


def _parts_steps(model: nn.Module, level: list[str], forward: Callable[[], Any], mode: Any,
                 around: list[str], keep: _Recorder) -> dict[str, tuple[_Recorder, dict[str, int], set[str]]]:
    """Option -> (the memory step's recorder, recomputed FLOPs by part, the parts that cannot run under it) with
    every part of ``level`` under it where it runs; ``keep``'s memory step is given (it ran first, to find the
    parts called twice)."""
    stepped = {"keep": (keep, set())} | {o: _step_where_it_runs(model, level, forward, o, mode, around)
                                         for o in PART_OPTIONS if o != "keep"}
    return {o: (r, dict(r.flops) if o != "keep" else {}, lacking) for o, (r, lacking) in stepped.items()}


def _with_inside(measured: Profile) -> Profile:
    """``measured`` with each layer's options inside it (``inside.py``), from its parts' options and chains."""
    if not measured.chains:
        return measured
    leaves = {layer.name: {o: c for o, c in layer.options.items() if o in OPTIONS} for layer in measured.layers}
    layers = [LayerProfile(layer.name, with_inside(layer.name, leaves | measured.parts, measured.chains))
              for layer in measured.layers]
    return replace(measured, layers=layers)


def with_times(measured: Profile, times: LayerTimes) -> Profile:
    """``measured`` with each option's added step time from ``times``.

    An option timed eagerly adds at least nothing: it runs what ``keep`` runs and
    more, so a negative difference is the machine's noise, read as 0. One timed
    compiled may save time: fused, a recomputation costs less than writing and
    reading back what it replaces (on the example GPT, CPU inductor, ``selective``
    on every block is 5 % faster than compiled ``none``; issue #22), and a layer
    ``ckpt.compile`` compiles runs faster than the eager one it replaces; so its
    difference stands, negative or not, and the planner takes the faster plan.

    Where an option was timed compiled, its kept bytes are what its compiled call
    keeps (``LayerTimes.kept_bytes``), its running bytes move by as much, and the
    peak without checkpointing, when ``keep`` ran compiled, by the sum over the
    layers: the step as it will run. The rest of the model keeps its eager bytes,
    or, where the whole step was measured compiled (``compiled_rest_bytes``), the
    larger of those and what it keeps compiled.
    """
    layers, shift = [], 0
    for layer in measured.layers:
        compiled = times.kept_bytes.get(layer.name, {})
        options = {}
        for o, c in layer.options.items():
            if o not in OPTIONS:  # an option inside the layer: made again below, from its parts' times
                continue
            added = times.added(layer.name, o)
            c = replace(c, seconds=added if o in times.compiled else max(added, 0.0))
            if o in compiled:
                delta = compiled[o] - c.kept_bytes
                c = replace(c, kept_bytes=compiled[o], running_bytes=max(c.running_bytes + delta, compiled[o]))
            options[o] = c
        shift += compiled["keep"] - layer.options["keep"].kept_bytes if "keep" in compiled else 0
        layers.append(LayerProfile(layer.name, options))
    parts = {name: {o: replace(c, seconds=max(times.added(name, o), 0.0)) for o, c in options.items()}
             if name in times.seconds else options for name, options in measured.parts.items()}
    rest = max(times.compiled_rest_bytes or 0, measured.rest_bytes) - measured.rest_bytes
    return _with_inside(replace(measured, layers=layers, parts=parts, none_seconds=times.predicted_none_seconds,
                                timed_as=times.how, no_ckpt_peak=measured.no_ckpt_peak + shift,
                                rest_bytes=measured.rest_bytes + rest, rest_running=measured.rest_running + rest))


def wrap_plan(chosen: Plan, preserve_rng_state: bool = True, regrouped: tuple[str, ...] = ()) -> WrapPlan:
    """``chosen`` as a plan the engine installs: each layer with its option (``keep`` stays unwrapped).

    A part (``inside.py``) is just another module name: wrapped on its own, or
    inside its wrapped layer (nested checkpoints); an ``inside`` layer stays unwrapped.
    ``regrouped``: the layers profiled with op groups (``Profile.regrouped``); those
    with a part in the plan run as op groups (``WrapPlan.regroup``), their parts being groups.

    The planner decides and never installs; the names keep ``chosen``'s order.
    """
    how = {option: treatment(option, preserve_rng_state) for option in OPTIONS} | {INSIDE: None}
    groups = tuple(EachLayer((name,), how[option]) for name, option in chosen.choices.items() if how[option] is not None)
    return WrapPlan(groups, summary=f"ckpt=auto plan:\n{chosen}", planned=chosen,
                    regroup=_regrouped(regrouped, chosen.choices))


def _regrouped(regrouped: tuple[str, ...], choices: Mapping[str, str]) -> tuple[str, ...]:
    """The layers of ``regrouped`` that run as op groups under ``choices``: those with a part in it. The
    others run their own forward, as their own options were measured (a traced forward may free sooner)."""
    return tuple(layer for layer in regrouped if any(n.startswith(f"{layer}.") for n in choices))


def chain_costs(model: nn.Module, names: list[str], forward: Callable[[], Any], *,
                fake: bool = True) -> tuple[ChainCosts, int]:
    """What ``planning/rotor.py`` plans a chain of ``names`` (in the order they run) with, and the act peak without.

    Two steps on fake tensors (``fake=False``: real ones, for tests): memory
    with every layer as it is and with every layer checkpointed alone, which
    splits into its forward inside a region and its recomputation as a region's
    last layer, and the FLOPs the second counts (forward and recomputed).
    """
    names = list(dict.fromkeys(names))
    check_candidates(model, names)
    with (cache_warnings_silenced(), checkpointing_disabled(model),
          fake_measurement(model, "ckpt.segments=optimal's profile") as mode):
        mode = mode if fake else None
        plain = _step(model, names, forward, "keep", fake=mode)
        alone = counted = _step(model, names, forward, "full", fake=mode)
    kept, running, peak = plain.analyse()
    inputs = alone.analyse()[0]  # checkpointed, a layer keeps its inputs only
    phase = alone.phase_running
    costs = ChainCosts(
        input_bytes=tuple(inputs.get(n, 0) for n in names),
        kept_bytes=tuple(max(kept.get(n, 0) - inputs.get(n, 0), 0) for n in names),
        running_bytes=tuple(running.get(n, 0) for n in names),
        region_running_bytes=tuple(phase.get((n, "forward"), 0) for n in names),
        last_running_bytes=tuple(phase.get((n, "recompute"), 0) for n in names),
        flops=tuple(counted.forward_flops.get(n, 0) for n in names),
        last_flops=tuple(counted.flops.get(n, 0) for n in names),
        after_running=running.get(REST, 0),
        backward_bytes=plain.backward_held,
    )
    return costs, peak


__all__ = [
    "Budget",
    "chain_costs",
    "Cost",
    "LayerProfile",
    "OPTIONS",
    "Plan",
    "Profile",
    "ProfileCache",
    "with_times",
    "wrap_plan",
    "parse_budget",
    "plan",
    "profile",
    "resolve",
    "treatment",
]

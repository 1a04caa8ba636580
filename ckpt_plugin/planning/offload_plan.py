"""Offload, planned per layer: what the link can carry while the step computes, and nothing more.

    clocks = Clocks(layers={"blocks.0": LayerClock(0.004, 0.012), ...}, rest_forward_s=..., rest_backward_s=...,
                    link=Link(25e9, 25e9, "given"))
    timeline(clocks, [("blocks.0", OFFLOAD, 0.0, 2 << 20), ...]).exposed_s   # copy time the compute cannot hide

Offloading every layer's saved tensors moved 21 GB per step on the bench's 805 M
GPT (docs/gpu.md): 0.38 s each way at the measured 55 GB/s, against a forward
of about 60 ms. No schedule hides that; a plan can. So ``ckpt=auto`` and
``ckpt.memory`` get two more options per layer: ``offload`` (the layer's saved
tensors kept in host memory) and ``full+offload`` (checkpointed, its inputs kept
there), priced by the copy time they expose.

**The two streams, as the engine runs them** (``engine/offload_copies.py``), over
the layers in the order they run. Forward: layer ``i`` computes for its forward
time; an offloaded layer's copy out is queued when it ends, on the out stream,
after the copies before it; as it ends, the offloaded layers more than ``ahead``
before it leave the device, the compute waiting for their copies out. Then the
rest of the model (head, loss) runs forward and backward; as backward begins, the
last ``ahead`` leave too. Backward, layers in reverse: an offloaded layer's first
unpack brings its bytes back if they are not yet (on demand: the last), then sends back
the next ``ahead`` offloaded layers in backward order (prefetch), each after its
copy out; the layer's backward starts once its own bytes have arrived. Each
layer's work is taken to be issued when the device reaches it (a host running
ahead only starts copies sooner). The step's time is when the last backward
ends; what it adds over the compute alone is the *exposed* copy time.
:func:`timeline` is that simulation, exactly; nothing else predicts it.

**Choosing.** The planner's dynamic programme (``planner.py``) needs a cost per
option; exposure is not additive (layers share the link, and only the last
offloaded layer's bytes come back on demand). So an offload option's cost starts
as what offloading that layer exposes where another offloaded layer follows it
(:func:`between`), the last offloaded layer's copy back is added at the end of
the programme (:func:`last_back`, from its state), the plan is simulated, and where
the whole exposes more than it was priced at, the difference is charged to its
offload options, spread by the bytes they copy, and the plan is chosen again, a
few times (as ``Profile.fit`` charges a peak it under-predicted); the plan kept
is the fastest *as simulated* among those, and the best plan without offload,
so that allowing offload never predicts slower.

**Memory.** An offloaded layer keeps on the device only what does not move
(small storages, parameters); what it moves stays on the device until the
offloaded layer ``ahead`` after it ends, and comes back ahead of use in backward,
beside the layers between it and the next offloaded one. So the planner counts the
moved bytes of the last ``ahead`` offloaded layers beside every later layer's
running bytes and the rest's (``planner.py``: a state of its dynamic programme):
exact for this engine, in the allocator's order. One offloaded layer alone saves
nothing in forward (its bytes stay until backward begins); a run of them saves all
but the last ``ahead``.

**No link, no offload.** On a CPU there is no link: the saved tensors already
live in host memory. Where no bandwidth was measured, offload is never chosen,
and the plan says why in one line (:func:`no_link_line`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ckpt_plugin.engine.offload_copies import PREFETCH_AHEAD
from ckpt_plugin.planning.options import FULL, FULL_OFFLOAD, KEEP, OFFLOAD, Option
from ckpt_plugin.units import format_bytes


@dataclass(frozen=True)
class Link:
    """The device's link to host memory: pinned copies' bytes per second each way, and how it was found."""

    out_bytes_per_s: float  # device to host
    back_bytes_per_s: float  # host to device
    how: str = "given"

    def __post_init__(self) -> None:
        for name in ("out_bytes_per_s", "back_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:  # also NaN
                raise ValueError(f"Link.{name} must be > 0 bytes per second, got {value!r}")

    def __str__(self) -> str:
        return f"{_rate(self.out_bytes_per_s)} out, {_rate(self.back_bytes_per_s)} back ({self.how})"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


@dataclass(frozen=True)
class LayerClock:
    """One layer's compute: its forward, and its forward and backward together without checkpointing."""

    forward_s: float
    keep_s: float  # forward + backward under keep; an option's own adds its Cost.seconds

    @property
    def backward_s(self) -> float:
        return max(self.keep_s - self.forward_s, 0.0)


@dataclass(frozen=True)
class Clocks:
    """What the two streams' timeline is simulated from: each layer's compute, the rest's, the link."""

    layers: Mapping[str, LayerClock]
    rest_forward_s: float  # the model outside the layers (embedding, head, loss), forward
    rest_backward_s: float
    link: Link
    ahead: int = PREFETCH_AHEAD  # offloaded calls in flight beside the running one, either way (the engine's)


# One layer as the timeline sees it: its name, its option, the seconds its option adds over keep, and the
# bytes its copies move each way (0: not offloaded).
Step = tuple[str, Option, float, int]


@dataclass(frozen=True)
class Timeline:
    """:func:`timeline`'s answer: the step as the two streams run it."""

    step_s: float  # forward and backward, copies waited for
    compute_s: float  # forward and backward alone
    moved_bytes: int  # copied out (and back) per step

    @property
    def exposed_s(self) -> float:
        """Copy time the compute could not hide, to the nanosecond."""
        return _ns(max(self.step_s - self.compute_s, 0.0))


def timeline(clocks: Clocks, steps: Iterable[Step]) -> Timeline:
    """The step with ``steps`` (every layer, in the order they run) on two copy streams beside the compute.

    Simulated as the engine runs it (this module's docstring): exact for that schedule,
    given each layer's times and the link's bandwidth.
    """
    steps = list(steps)
    link, ahead = clocks.link, clocks.ahead
    now = compute = 0.0
    out_free = 0.0  # when the out stream is next idle
    out_done: dict[int, float] = {}  # step index -> when its copy out ends
    offloaded: list[int] = []  # step indices offloaded, forward order
    gone: set[int] = set()  # offloaded steps whose bytes have left the device (the compute waited for their copy)
    for i, (name, _option, added, moved) in enumerate(steps):
        layer = clocks.layers[name]
        now += layer.forward_s
        compute += layer.forward_s
        if moved:
            start = max(now, out_free)
            out_done[i] = out_free = start + moved / link.out_bytes_per_s
            offloaded.append(i)
            for k in offloaded[:len(offloaded) - ahead]:  # the call ends: those more than `ahead` back leave
                if k not in gone:
                    now = max(now, out_done[k])
                    gone.add(k)
    now += clocks.rest_forward_s + clocks.rest_backward_s
    compute += clocks.rest_forward_s + clocks.rest_backward_s
    for k in offloaded:  # backward begins: the last `ahead` leave too, the compute waiting for their copies
        if k not in gone:
            now = max(now, out_done[k])
    back_free = 0.0
    back_done: dict[int, float] = {}
    for i in range(len(steps) - 1, -1, -1):
        name, _option, added, moved = steps[i]
        layer = clocks.layers[name]
        if moved:
            at = offloaded.index(i)
            to_send = [] if i in back_done else [i]  # on demand: nothing brought it back ahead
            to_send += [j for j in reversed(offloaded[max(at - ahead, 0):at]) if j not in back_done]
            for j in to_send:
                start = max(now, back_free, out_done[j])
                back_done[j] = back_free = start + steps[j][3] / link.back_bytes_per_s
            now = max(now, back_done[i])
        backward = layer.backward_s + added
        now += backward
        compute += backward
    return Timeline(now, compute, sum(s[3] for s in steps))


def between(clocks: Clocks, names: list[str], i: int, copied: int) -> float:
    """The copy time offloading layer ``i`` (``names[i]``, copying ``copied`` bytes each way) exposes where an
    offloaded layer follows it, every other kept: its copy out beyond the next layer's forward (the next call's
    end lets it go), its copy back beyond the next layer's backward (prefetched as that one's begins). The
    planner's price for the option; the last offloaded layer's copy back, on demand, is priced apart
    (:func:`last_back`), the whole by :func:`timeline`."""
    link = clocks.link
    if i + 1 < len(names):
        after = clocks.layers[names[i + 1]]
        return _ns(max(copied / link.out_bytes_per_s - after.forward_s, 0.0)
                   + max(copied / link.back_bytes_per_s - after.backward_s, 0.0))
    return _ns(max(copied / link.out_bytes_per_s - clocks.rest_forward_s - clocks.rest_backward_s, 0.0))


def _ns(seconds: float) -> float:
    """``seconds`` to the nanosecond: copy times below it are no time, and must not decide between plans (over a
    link taken as unlimited, 1e-23 s would put a smaller last layer before fewer layers offloaded)."""
    return round(seconds, 9)


def last_back(clocks: Clocks, pending: tuple[int, ...]) -> float:
    """The copy back of the last offloaded layers (``pending``: their bytes, the planner's state), on demand as
    backward begins: nothing runs before it to hide it."""
    return _ns(sum(pending) / clocks.link.back_bytes_per_s)


@dataclass(frozen=True)
class Moves:
    """What offloading a layer would move, measured on fake tensors (``recorder.py``), by the layer's own option."""

    device_bytes: Mapping[Option, int]  # of its kept bytes, those that leave the device (keep, full)
    copied_bytes: Mapping[Option, int]  # what its copies carry each way (every storage it saves that moves)


def offload_costs(names: list[str], i: int, options: Mapping[Option, object], moves: Moves,
                  clocks: Clocks) -> dict[Option, object]:
    """Layer ``names[i]``'s two offload options as :class:`~ckpt_plugin.planning.planner.Cost` s (``offload``
    from its ``keep``, ``full+offload`` from its ``full``): on the device it keeps what does not move, its
    running bytes stay, its cost is what the option it offloads adds plus the exposure :func:`between` prices.
    A layer that would move nothing gets neither."""
    made = {}
    for offloaded, base in ((OFFLOAD, KEEP), (FULL_OFFLOAD, FULL)):
        cost = options.get(base)
        device, copied = moves.device_bytes.get(base, 0), moves.copied_bytes.get(base, 0)
        if cost is None or device <= 0 or copied <= 0:
            continue
        exposed = between(clocks, names, i, copied)
        made[offloaded] = replace(cost, kept_bytes=max(cost.kept_bytes - device, 0), moved_bytes=device,
                                  copied_bytes=copied, seconds=cost.seconds + exposed, exposed_seconds=exposed)
    return made


_TRIES = 4  # plans chosen again with what the last one exposed beyond its price charged to its offload options


def steps_of(profiles: list, chosen: tuple[Option, ...]) -> list[Step]:
    """The timeline's steps for ``chosen`` (one option per layer of ``profiles``), from the options' costs."""
    return [(p.name, o, p.options[o].seconds - p.options[o].exposed_seconds, p.options[o].copied_bytes if o.offload
             else 0) for p, o in zip(profiles, chosen)]


def simulated_seconds(profiles: list, chosen: tuple[Option, ...], clocks: Clocks) -> tuple[float, float]:
    """(what ``chosen`` adds to the step over keeping every layer, of which copy time exposed), as simulated."""
    steps = steps_of(profiles, chosen)
    exposed = timeline(clocks, steps).exposed_s
    return sum(added for _, _, added, _ in steps) + exposed, exposed


def fastest_as_simulated(profiles: list, first: tuple, cheapest, clocks: Clocks) -> tuple:
    """The dynamic programme's ``first`` (cost, choices) or a plan chosen again, whichever the timeline finds
    fastest: where ``first`` exposes more copy time than its offload options were priced at (each alone), that
    difference is charged to them, spread by the bytes they copy, and ``cheapest(layers)`` chooses again; the
    best plan without offload competes too. ``profiles``: the layers, each with its offload options."""
    candidates, seen, layers, current = [first], {first[1]}, profiles, first
    plain = [replace(p, options={o: c for o, c in p.options.items() if not o.offload}) for p in profiles]
    if all(p.options for p in plain):
        without = cheapest(plain)
        if without is not None:
            candidates.append(without)
    for _ in range(_TRIES):
        chosen = current[1]
        exposed = timeline(clocks, steps_of(profiles, chosen)).exposed_s
        last = [p.options[o].moved_bytes for p, o in zip(layers, chosen) if o.offload][-clocks.ahead:]
        priced = sum(p.options[o].exposed_seconds for p, o in zip(layers, chosen)) + last_back(clocks, tuple(last))
        copied = sum(p.options[o].copied_bytes for p, o in zip(layers, chosen) if o.offload)
        if exposed <= priced or not copied:
            break
        more = exposed - priced
        layers = [replace(p, options={o: replace(c, seconds=c.seconds + more * c.copied_bytes / copied,
                                                 exposed_seconds=c.exposed_seconds + more * c.copied_bytes / copied)
                                      if o == key and o.offload else c for o, c in p.options.items()})
                  for p, key in zip(layers, chosen)]
        current = cheapest(layers)
        if current is None or current[1] in seen:
            break
        seen.add(current[1])
        candidates.append(current)
    return min(candidates, key=lambda c: (simulated_seconds(profiles, c[1], clocks)[0],
                                          sum(o.offload for o in c[1]), c[0]))


def clocks_of(layers: list, times, link: Link) -> Clocks:
    """The timeline's inputs from ``times`` (``timing.py``'s ``LayerTimes``): each layer's forward and its keep
    step, and the rest of the model's step (the step without checkpointing, predicted, less the layers'), split
    into forward and backward in the layers' own proportion (it is not timed apart)."""
    clocks = {layer.name: LayerClock(times.forward_seconds.get(layer.name, 0.0), times.seconds[layer.name][KEEP])
              for layer in layers}
    keep = sum(c.keep_s for c in clocks.values())
    share = sum(c.forward_s for c in clocks.values()) / keep if keep > 0 else 1 / 3
    rest = max(times.predicted_none_seconds - keep, 0.0)
    return Clocks(clocks, rest * share, rest * (1 - share), link)


def with_offload(measured, times, moves: Mapping[str, Moves], link: Link | None, no_link: str):
    """``measured`` (a timed ``Profile``) with each layer's offload options, priced on ``link``; as it was, with
    the line that says why (``no_link``), where there is no link (a CPU), or the options were timed compiled."""
    if link is None:
        return replace(measured, offload_note=no_link)
    if times.compiled:
        return replace(measured, offload_note="offload: not an option where the options are timed compiled "
                                              "(ckpt.timing=eager plans it)")
    clocks = clocks_of(measured.layers, times, link)
    names = [layer.name for layer in measured.layers]
    layers = [replace(layer, options={**layer.options, **offload_costs(names, i, layer.options,
                                                                         moves.get(layer.name, Moves({}, {})),
                                                                         clocks)})
              for i, layer in enumerate(measured.layers)]
    return replace(measured, layers=layers, clocks=clocks, offload_note=f"offload priced on the host link: {link}")


def fixed_timeline(measured, option: Option) -> Timeline:
    """The step with every layer of ``measured`` (a ``Profile`` with clocks) under ``option`` (``offload``, or
    ``full+offload``) where it has that option, else under the option it offloads (a layer moving nothing)."""
    base = KEEP if option == OFFLOAD else FULL
    steps = []
    for layer in measured.layers:
        cost = layer.options.get(option) or layer.options[base]
        moved = cost.copied_bytes if option in layer.options else 0
        steps.append((layer.name, option, cost.seconds - cost.exposed_seconds, moved))
    return timeline(measured.clocks, steps)


def cannot_hide(line: Timeline, link: Link, mode: str, layers: str, peak: int) -> str | None:
    """The warning of a fixed offload mode whose copies need more time than the step computes; None where
    they need less. ``mode``: how the run names the mode (``ckpt=offload``); ``layers``: its ``ckpt.layers``;
    ``peak``: the activation peak it reaches (predicted), for the budget that plans the same memory."""
    copies = line.moved_bytes / link.out_bytes_per_s + line.moved_bytes / link.back_bytes_per_s
    if copies <= line.compute_s:
        return None
    return (f"{mode} moves {format_bytes(line.moved_bytes)} ({line.moved_bytes} B) per step to host memory and "
            f"back: {1e3 * copies:.1f} ms of copies at {link}, against {1e3 * line.compute_s:.1f} ms of compute in "
            f"the step, so they cannot hide behind it: predicted step {line.step_s / line.compute_s:.2f}x the same "
            f"step without offload (+{1e3 * line.exposed_s:.1f} ms, two streams simulated over the layers' times). "
            f"Plan it instead: ckpt=auto ckpt.layers={layers} ckpt.memory=device offloads only what the compute "
            f"hides (the fastest plan that fits the device), or ckpt.budget={peak}B plans the activation memory "
            "this offload reaches")


def no_link_line(device: str) -> str:
    """The one line a plan says where offload was not an option."""
    if device == "cpu":
        return ("offload: not an option on a CPU: the saved tensors already live in host memory, there is no "
                "link to carry them")
    return f"offload: not an option: no host link was measured for {device}"


__all__ = ["Clocks", "LayerClock", "Link", "Moves", "Step", "Timeline", "between", "cannot_hide", "clocks_of",
           "fastest_as_simulated", "fixed_timeline", "last_back", "no_link_line", "offload_costs", "simulated_seconds", "steps_of",
           "timeline", "with_offload"]

"""Offload planned per layer (issue #41, item 2): ``offload`` and ``full+offload`` beside keep, selective and
full, priced by the copy time the compute cannot hide, on synthetic layer times and bandwidths.

The planner's exposed copy time is checked against a two-stream timeline simulated here independently (a
generic scheduler of ops on streams with dependencies, not ``offload_plan.timeline``); bytes and choices are
exact; on a CPU (no host link) offload is never an option, and a real ``ckpt=auto`` run says so in one line.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import gpt_batch, small_gpt

from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.planning.offload_plan import (
    Clocks,
    LayerClock,
    Link,
    Moves,
    no_link_line,
    offload_costs,
    timeline,
)
from ckpt_plugin.planning.options import FULL, FULL_OFFLOAD, KEEP, OFFLOAD, parse
from ckpt_plugin.planning.plan_file import load_plan, save_plan
from ckpt_plugin.planning.planner import Cost, LayerProfile, Profile, predicted_peak
from ckpt_plugin.planning.steps import treatment
from ckpt_plugin.units import format_bytes

MiB = 1 << 20


# --- an independent two-stream timeline -----------------------------------------------------------


def scheduled(ops: list[tuple[str, str, float, list[str], str | None]]) -> dict[str, float]:
    """End times of ``ops`` = (name, stream, seconds, names it waits for, the compute op at whose start the host
    issues it, or None: in order). Each stream runs its ops in the order given; an op starts when its stream is
    free, its dependencies have ended and the compute stream has reached the op it is issued at."""
    end: dict[str, float] = {}
    start: dict[str, float] = {}
    free: dict[str, float] = {}
    pending = list(ops)
    while pending:
        for op in pending:
            name, stream, seconds, deps, issued_at = op
            if any(d not in end for d in deps) or (issued_at is not None and issued_at not in start):
                continue
            if any(o[1] == stream for o in pending[:pending.index(op)]):
                continue  # an earlier op of its stream has not run yet
            at = max([free.get(stream, 0.0), *(end[d] for d in deps)] + ([start[issued_at]] if issued_at else []))
            start[name], end[name] = at, at + seconds
            free[stream] = end[name]
            pending.remove(op)
            break
        else:
            raise AssertionError(f"deadlock: {pending}")
    return end


def independent_exposure(clocks: Clocks, steps: list[tuple[str, float, int]]) -> float:
    """What ``steps`` (name, added backward seconds, bytes moved) expose, by :func:`scheduled`: as the engine runs
    them, each op issued when the compute stream reaches it."""
    link, ahead, ops = clocks.link, clocks.ahead, []
    offloaded = [i for i, (_, _, moved) in enumerate(steps) if moved]
    previous: str | None = None
    for i, (name, _, moved) in enumerate(steps):
        ops.append((f"f{i}", "compute", clocks.layers[name].forward_s, [previous] if previous else [], None))
        previous = f"f{i}"
        if moved:
            ops.append((f"out{i}", "out", moved / link.out_bytes_per_s, [f"f{i}"], None))
            at = offloaded.index(i)
            if at >= ahead:  # the call ends: the compute waits for the copy of the call `ahead` back, then goes on
                ops.append((f"wait{i}", "compute", 0.0, [previous, f"out{offloaded[at - ahead]}"], None))
                previous = f"wait{i}"
    ops.append(("rest", "compute", clocks.rest_forward_s + clocks.rest_backward_s, [previous], None))
    previous = "rest"
    last = offloaded[len(offloaded) - ahead:] if ahead else []  # still on the device: backward waits their copies
    ops.append(("begin", "compute", 0.0, [previous, *(f"out{k}" for k in last)], None))
    previous = "begin"
    sent: set[int] = set()
    for i in reversed(range(len(steps))):
        name, added, moved = steps[i]
        waits = [previous]
        if moved:
            at = offloaded.index(i)
            for j in ([i] if i not in sent else []) + [j for j in reversed(offloaded[max(at - ahead, 0):at])
                                                     if j not in sent]:
                sent.add(j)
                ops.append((f"back{j}", "back", steps[j][2] / link.back_bytes_per_s, [f"out{j}", previous], None))
            waits.append(f"back{i}")
        ops.append((f"b{i}", "compute", clocks.layers[name].backward_s + added, waits, None))
        previous = f"b{i}"
    end = scheduled(ops)
    compute = sum(c.forward_s + c.backward_s for c in (clocks.layers[n] for n, _, _ in steps))
    compute += clocks.rest_forward_s + clocks.rest_backward_s + sum(a for _, a, _ in steps)
    return max(end[previous] - compute, 0.0)


# --- synthetic profiles -----------------------------------------------------------------------------


def synthetic(sizes: list[int], link: Link | None, *, forward_s: float = 0.010, seed: int | None = None,
              rest: int = MiB) -> Profile:
    """Layers keeping ``sizes[i]`` bytes (all of which would move), running 1.5x that, full keeping 1/16 of it
    for one forward recomputed; compute times ``forward_s`` forward and twice that backward (perturbed by
    ``seed``); offload options priced on ``link`` (None: none)."""
    rng = random.Random(seed)
    names = [f"blocks.{i}" for i in range(len(sizes))]
    jitter = (lambda: rng.uniform(0.5, 1.5)) if seed is not None else (lambda: 1.0)
    clocks_of = {n: LayerClock(forward_s * jitter(), 3 * forward_s * jitter()) for n in names}
    layers = []
    for name, size in zip(names, sizes):
        forward = clocks_of[name].forward_s
        options = {KEEP: Cost(size, 0, size + size // 2),
                   FULL: Cost(size // 16, 10 ** 9, size + size // 2, seconds=forward)}
        layers.append(LayerProfile(name, options))
    rest_s = 4 * forward_s
    profile = Profile(layers, rest_bytes=rest, rest_running=2 * rest, no_ckpt_peak=sum(sizes) + 3 * rest,
                      none_seconds=sum(c.keep_s for c in clocks_of.values()) + rest_s)
    if link is None:
        return profile
    clocks = Clocks(clocks_of, rest_s / 3, 2 * rest_s / 3, link)
    moves = {name: Moves({KEEP: size, FULL: size // 16}, {KEEP: size, FULL: size // 16})
             for name, size in zip(names, sizes)}
    offered = [LayerProfile(layer.name, {**layer.options, **offload_costs(names, i, layer.options, moves[layer.name],
                                                                           clocks)})
               for i, layer in enumerate(layers)]
    return Profile(offered, profile.rest_bytes, profile.rest_running, profile.no_ckpt_peak,
                   none_seconds=profile.none_seconds, clocks=clocks, offload_note=f"offload priced on: {link}")


def exposure_of(profile: Profile, plan) -> float:
    steps = []
    for layer, option in zip(profile.layers, plan.keys):
        cost = layer.options[option]
        steps.append((layer.name, cost.seconds - cost.exposed_seconds, cost.copied_bytes if option.offload else 0))
    return independent_exposure(profile.clocks, steps)


# --- the timeline ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_the_plans_exposed_copy_time_is_the_independent_timelines(seed):
    """For plans over random layer times and sizes, at several budgets and bandwidths, the planner's predicted
    exposed copy time equals the two streams simulated independently."""
    rng = random.Random(seed)
    sizes = [rng.randrange(4, 64) * MiB for _ in range(rng.randrange(3, 9))]
    offloaded = 0
    for gbps in (1.0, 8.0, 40.0):
        profile = synthetic(sizes, Link(gbps * 1e9, gbps * 1e9 * rng.uniform(0.7, 1.3)), seed=seed)
        least = profile.least().predicted_peak
        for share in (0.9, 0.6, 0.3, 0.0):  # of the way from the least peak to the one without checkpointing
            plan = profile.plan(int(least + share * (profile.no_ckpt_peak - least)))
            # To the nanosecond, as the timeline gives it (offload_plan._ns).
            assert plan.offload_exposed_seconds == pytest.approx(exposure_of(profile, plan), rel=0, abs=1e-9)
            offloaded += any(o.offload for o in plan.keys)
    assert offloaded  # the case where it matters was met


def test_the_timeline_on_a_hand_worked_case():
    """Two layers of 10 ms forward and 20 ms backward, the rest 6 ms; 100 MB each at 2.5 GB/s (40 ms a copy).
    a's copy out runs 10 to 50 ms; as b ends at 20 ms, a must leave the device: the compute waits until 50 ms
    (30 ms exposed). b's copy out runs 50 to 90 ms; the rest ends at 56 ms, and as backward begins b leaves too:
    the compute waits until 90 ms (34 ms). b comes back on demand, 90 to 130 ms (40 ms), then a, prefetched, 130
    to 170 ms behind b's backward (130 to 150 ms): a's backward waits 20 ms. 124 ms exposed in all."""
    clocks = Clocks({"a": LayerClock(0.010, 0.030), "b": LayerClock(0.010, 0.030)}, 0.002, 0.004,
                    Link(2.5e9, 2.5e9))
    line = timeline(clocks, [("a", OFFLOAD, 0.0, 10 ** 8), ("b", OFFLOAD, 0.0, 10 ** 8)])
    assert line.compute_s == pytest.approx(0.066)
    assert line.exposed_s == pytest.approx(0.124)
    assert independent_exposure(clocks, [("a", 0.0, 10 ** 8), ("b", 0.0, 10 ** 8)]) == pytest.approx(0.124)


# --- what the planner chooses ------------------------------------------------------------------------


def test_unlimited_bandwidth_offloads_what_saves_most_and_recomputes_nothing():
    """Copies that cost nothing: every budget that keep and offload alone can meet is met without recomputing,
    with as few layers offloaded as any such plan (the ones that save most)."""
    sizes = [8 * MiB, 40 * MiB, 16 * MiB, 24 * MiB, 12 * MiB]
    profile = synthetic(sizes, Link(1e30, 1e30))
    plans = {keys: predicted_peak(profile.layers, keys, profile.rest_running)[0]
             for keys in itertools.product((KEEP, OFFLOAD), repeat=len(sizes))}
    lowest = min(plans.values())
    fewest_seen = set()
    for share in (0.9, 0.6, 0.3, 0.0):
        budget = int(lowest + share * (profile.no_ckpt_peak - lowest))
        plan = profile.plan(budget)
        assert plan.recompute_flops == 0 and plan.offload_exposed_seconds == pytest.approx(0.0, abs=1e-12)
        fewest = min(sum(o.offload for o in keys) for keys, peak in plans.items() if peak <= budget)
        assert sum(o.offload for o in plan.keys) == fewest
        fewest_seen.add(fewest)
    assert len(fewest_seen) > 1  # the budgets asked for different numbers of layers offloaded
    assert max(fewest_seen) >= 2  # one offloaded layer alone saves nothing: its bytes stay until the next's end


def test_no_bandwidth_never_offloads_and_a_slow_link_loses_to_recomputation():
    sizes = [8 * MiB, 40 * MiB, 16 * MiB, 24 * MiB]
    plain = synthetic(sizes, None)
    assert all(not o.offload for layer in plain.layers for o in layer.options)
    for budget in (plain.no_ckpt_peak - 30 * MiB, plain.least().predicted_peak):
        assert not any(o.offload for o in plain.plan(budget).keys)
    slow = synthetic(sizes, Link(1e6, 1e6))  # 1 MB/s: seconds per layer, against 30 ms of compute
    plan = slow.plan(slow.no_ckpt_peak - 30 * MiB)
    assert not any(o.offload for o in plan.keys) and FULL in plan.keys


def test_offload_priced_between_the_two():
    """At a bandwidth where one layer's copies hide and all of them would not, the plan offloads some and its
    predicted step is no slower than the best plan without offload at the same budget."""
    sizes = [32 * MiB] * 8
    profile = synthetic(sizes, Link(4e9, 4e9))
    plain = synthetic(sizes, None)
    budget = int(0.45 * profile.no_ckpt_peak)
    plan, without = profile.plan(budget), plain.plan(budget)
    assert 0 < sum(o.offload for o in plan.keys) < len(sizes)
    assert plan.predicted_time_ratio < without.predicted_time_ratio
    assert plan.predicted_peak <= budget


def test_the_peak_counts_the_last_offloaded_layers_bytes_beside_the_next():
    """Copies in flight out, and the layer prefetched back: the last offloaded layer's moved bytes count beside
    every later layer's running bytes and the rest's."""
    profile = synthetic([10 * MiB, 20 * MiB, 30 * MiB], Link(1e30, 1e30))
    layers = profile.layers
    keys = (OFFLOAD, KEEP, OFFLOAD)
    peak, at = predicted_peak(layers, keys, profile.rest_running)
    moved = [layer.options[o].moved_bytes if o.offload else 0 for layer, o in zip(layers, keys)]
    kept = [layer.options[o].kept_bytes for layer, o in zip(layers, keys)]
    running = [layer.options[o].running_bytes for layer, o in zip(layers, keys)]
    terms = [running[0], kept[0] + running[1] + moved[0], kept[0] + kept[1] + running[2] + moved[0],
             sum(kept) + profile.rest_running + moved[2]]
    assert moved == [10 * MiB, 0, 30 * MiB] and kept[0] == kept[2] == 0
    assert peak == max(terms) and at == "blocks.2"


def test_every_choice_the_planner_makes_fits_and_is_never_slower_than_without_offload():
    """Four layers, every combination of keep, full, offload and full+offload enumerated, at five budgets: the
    plan's predicted peak fits; the timeline never predicts it slower than the fastest combination without offload
    (guaranteed: that one competes); and on this profile it is the fastest combination of all (the dynamic
    programme prices offload per layer, the timeline judges: a heuristic, exact here)."""
    profile = synthetic([12 * MiB, 30 * MiB, 18 * MiB, 6 * MiB], Link(6e9, 5e9), seed=3)
    least = profile.least().predicted_peak
    for share in (0.95, 0.7, 0.5, 0.35, 0.1):
        budget = int(least + share * (profile.no_ckpt_peak - least))
        plan = profile.plan(budget)
        assert plan.predicted_peak <= budget
        fits = {keys: _added(profile, keys) for keys in itertools.product(*(list(l.options) for l in profile.layers))
                if predicted_peak(profile.layers, keys, profile.rest_running)[0] <= budget}
        without = min(t for keys, t in fits.items() if not any(o.offload for o in keys))
        assert _added(profile, plan.keys) <= without
        assert _added(profile, plan.keys) == pytest.approx(min(fits.values()), rel=1e-9)


def _added(profile: Profile, keys) -> float:
    """The step time ``keys`` add over keeping every layer, as the timeline predicts it."""
    from ckpt_plugin.planning.offload_plan import simulated_seconds

    return simulated_seconds(profile.layers, tuple(keys), profile.clocks)[0]


# --- names, plan files, treatments ----------------------------------------------------------------


def test_the_offload_options_name_themselves_and_install_as_treatments():
    assert (str(OFFLOAD), str(FULL_OFFLOAD)) == ("offload", "full+offload")
    assert parse("offload") == OFFLOAD and parse("full+offload") == FULL_OFFLOAD
    off, full_off = treatment(OFFLOAD), treatment(FULL_OFFLOAD)
    assert (off.checkpointing, off.offload) == (False, True)
    assert (full_off.checkpointing, full_off.offload) == (True, True)


def test_a_plan_file_keeps_offload_choices(tmp_path):
    from ckpt_plugin.planning.profile import wrap_plan

    model = small_gpt(n_layer=4)
    sizes = [8 * MiB, 40 * MiB, 16 * MiB, 24 * MiB]
    profile = synthetic(sizes, Link(1e30, 1e30))
    least = profile.least().predicted_peak
    chosen = profile.plan(int(least + 0.3 * (profile.no_ckpt_peak - least)))
    assert any(o.offload for o in chosen.keys)
    plan = wrap_plan(chosen)
    path = tmp_path / "ckpt_plan.json"
    save_plan(plan, path, model)
    loaded = load_plan(path, model)
    assert loaded.names == plan.names
    assert [g.treatment for g in loaded.groups] == [g.treatment for g in plan.groups]
    assert {(g.treatment.checkpointing, g.treatment.offload) for g in loaded.groups} <= {(False, True), (True, True),
                                                                                       (True, False)}
    assert loaded.planned.choices == chosen.choices and loaded.planned.keys == chosen.keys
    assert loaded.planned.offload_bytes == chosen.offload_bytes > 0
    assert f"offloads {format_bytes(chosen.offload_bytes)} per step each way" in str(loaded.planned)


# --- a real run on the CPU ----------------------------------------------------------------------------


def test_a_cpu_run_never_chooses_offload_and_says_why_in_one_line(caplog):
    model = small_gpt(torch.float32, n_layer=4)
    batch = gpt_batch(model)
    with caplog.at_level("INFO", logger="ckpt_plugin"):
        wrapped = apply_config(model, make_config(mode="auto", layers="TransformerBlock", budget=0.3),
                               lambda: model.loss(batch))
    assert wrapped
    summary = "\n".join(r.getMessage() for r in caplog.records)
    assert summary.count(no_link_line("cpu")) == 1
    assert "offload" not in summary.replace(no_link_line("cpu"), "")


# --- the fixed mode's warning (item 3) -----------------------------------------------------------------


def test_the_warning_of_a_fixed_offload_mode_gives_both_numbers_the_slowdown_and_the_plan_instead():
    from ckpt_plugin.planning.offload_plan import Timeline, cannot_hide

    link = Link(2e9, 1e9, "given")
    line = Timeline(step_s=0.250, compute_s=0.100, moved_bytes=150_000_000)  # 75 ms out, 150 ms back
    assert cannot_hide(line, link, "ckpt=offload", "TransformerBlock", 123_456) == (
        "ckpt=offload moves 143.1 MiB (150000000 B) per step to host memory and back: 225.0 ms of copies at "
        "2.0 GB/s out, 1.0 GB/s back (given), against 100.0 ms of compute in the step, so they cannot hide behind "
        "it: predicted step 2.50x the same step without offload (+150.0 ms, two streams simulated over the layers' "
        "times). Plan it instead: ckpt=auto ckpt.layers=TransformerBlock ckpt.memory=device offloads only what the "
        "compute hides (the fastest plan that fits the device), or ckpt.budget=123456B plans the activation memory "
        "this offload reaches")
    fast = Link(4e9, 4e9)  # 37.5 ms + 37.5 ms: less than the compute
    assert cannot_hide(Timeline(0.100, 0.100, 150_000_000), fast, "ckpt=offload", "TransformerBlock", 1) is None


class _Block(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _lightning_net():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
            self.head = torch.nn.Linear(64, 1)
            self.example_input_array = torch.randn(32, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


def test_a_fit_with_ckpt_offload_warns_once_where_the_link_cannot_carry_it(monkeypatch, tmp_path):
    """A synthetic link of 1 MB/s (measure_link's answer replaced: there is no GPU here) under a real Trainer:
    one warning at fit start, whose bytes are those the engine then copies in a step (the copy path forced)."""
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_plugin import ActivationCheckpointing
    from ckpt_plugin.engine.offload import Offloading
    from ckpt_plugin.engine.wrap import offloaders_of
    from ckpt_plugin.planning import link as links

    monkeypatch.setattr(links, "measure_link", lambda device, *a, **k: Link(1e6, 1e6, "synthetic"))
    monkeypatch.setattr(Offloading, "_in_host_memory", ())
    torch.manual_seed(0)
    model = _lightning_net()
    data = DataLoader(TensorDataset(torch.randn(64, 64), torch.randn(64, 1)), batch_size=32)
    callback = ActivationCheckpointing(mode="offload", layers="_Block")
    installed = []

    class Look(pl.Callback):  # the installation's offloader, before teardown takes it off
        def on_train_batch_end(self, trainer, pl_module, *args):
            installed.extend(offloaders_of(pl_module))

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Look()],
                         default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    said = [str(w.message) for w in caught if "per step to host memory and back" in str(w.message)]
    assert len(said) == 1, said
    (offloader,) = installed
    moved = offloader.stats.bytes_out  # one step, the copies the engine made
    assert said[0].startswith(f"ckpt=offload moves {format_bytes(moved)} ({moved} B) per step")
    assert "ckpt=auto ckpt.layers=_Block ckpt.memory=device" in said[0]


def test_a_cpu_fit_with_ckpt_offload_measures_nothing_and_warns_nothing(monkeypatch, tmp_path):
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_plugin import ActivationCheckpointing
    from ckpt_plugin.planning import profile as profiles

    timed = []
    monkeypatch.setattr(profiles, "measure_layer_times", lambda *a, **k: timed.append(1))
    model = _lightning_net()
    data = DataLoader(TensorDataset(torch.randn(64, 64), torch.randn(64, 1)), batch_size=32)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ActivationCheckpointing(mode="offload", layers="_Block")], default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    assert not [w for w in caught if "per step to host memory and back" in str(w.message)]
    assert timed == []  # no link on a CPU: nothing is timed for it

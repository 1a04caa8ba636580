"""``ckpt-soak``: thousands of training steps per mode; tensors, their bytes and hooks must not grow.

    ckpt-soak                                         # every mode, 3000 steps each (tens of minutes on 2 CPU cores)
    ckpt-soak --steps 30 --trainer-steps 10 --out /tmp/soak.json    # under a minute
    python -m ckpt_tools.soak --modes full,offload_copy --steps 10000 --size quick

For each mode a fresh GPT (``--size tiny``, the tests' 4-block GPT, or
``quick``, ``ckpt-bench --quick``'s) is checkpointed with that mode's keys and
trains with AdamW on a new random batch every step: ``--warmup`` steps, a
snapshot (start), ``--steps`` steps, a snapshot (end). ``trainer_*`` modes
train the same model through a real Lightning ``Trainer`` with the
``ActivationCheckpointing`` callback (its saved-bytes counting hooks run on
every step: ``log_every_n_steps=1``) on the example ``TextData``, for
``--trainer-steps`` steps; their snapshots are taken in ``on_train_batch_end``.
Two more snapshots, before the model is built and after everything of the
mode (model, optimiser, trainer) has been dropped, show what the mode leaves
behind in the process (``left``): a leak per fit rather than per step.

A snapshot, after ``gc.collect()``:

- ``tensors``: live ``torch.Tensor`` objects (``gc.get_objects()``);
- ``tensor_bytes`` (``storages``): bytes (number) of the distinct storages of
  those tensors and of every storage an op has made since the mode began
  that is still alive (``LiveStorages``, a dispatch mode active throughout,
  holds each one weakly): together, every storage an op made, whether or not
  Python holds a tensor of it (what autograd saved in a graph, say), and every
  one a Python tensor uses, made by an op or not (``torch.tensor``, RNG states);
- ``hooks``: hooks on the model's modules (``_forward_hooks``,
  ``_forward_pre_hooks``, ``_backward_hooks``, ... every hook dict), on its
  parameters and its optimiser, and torch's global module and optimiser hooks;
- ``saved_hooks``: depth of the ``saved_tensors_hooks`` stack, and
  ``modes``: of the dispatch and function mode stacks (the soak's own excluded);
- ``rss``: the process's resident set (``/proc/self/status``): allocator and
  Python caches make it noisy, so it is reported, never checked.

Exit status 1 if, in any mode, an exact measure (all but ``rss``) is larger
at the end than at the start, or tensors, tensor bytes or hooks are left
after the mode that were not there before it; 0 otherwise; 2 for bad
arguments. Also reported: the objects (tensors among them) that one step
leaves in reference cycles, which only the cycle collector frees (the last
step runs with ``gc`` off).

``offload`` on CPU moves nothing (the saved activations already live in host
memory); ``offload_copy`` forces offload's copy path on CPU, as
``tests/test_offload.py`` does, so every saved activation goes through a host
buffer and back. Steps run on one thread by default (``--threads``): with a
Python dispatch mode on every op, a step is mostly Python, and on a shared
machine more threads only wait for each other.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from tqdm import tqdm

from ckpt_examples.data import TextData
from ckpt_examples.gpt import GPT
from ckpt_plugin.apply.install import apply_checkpointing
from ckpt_plugin.engine.offload import NOTHING_TO_MOVE, Offloading
from ckpt_plugin.errors import closest_first
from ckpt_plugin.lightning.callback import ActivationCheckpointing
from ckpt_tools.soak_snapshot import LiveStorages, Snapshot, counting_cycles
from ckpt_tools.workloads import MODELS
from ckpt_tools.workloads import MODES as BENCH_MODES

__all__ = ["MODES", "SIZES", "Snapshot", "main"]

LAYERS = "TransformerBlock"
SIZES: dict[str, dict[str, int]] = {
    "quick": MODELS["gpt"].quick,  # ckpt-bench --quick's GPT
    "tiny": dict(n_layer=4, n_embd=32, n_head=2, block_size=16, batch_size=2),  # the tests' small_gpt
}
LOOP_MODES: dict[str, dict[str, Any]] = {
    **{m: BENCH_MODES[m] for m in ("none", "full", "every_n_2", "segments_sqrt", "recursive", "selective")},
    "names": {"mode": "selective", "policy": "names", "save_names": ["attn_out"]},
    "offload": BENCH_MODES["offload"],
    "offload_copy": BENCH_MODES["offload"],  # with offload's copy path forced on CPU
    "auto_0.5": BENCH_MODES["auto_0.5"],
}
TRAINER_MODES = {f"trainer_{m}": keys for m, keys in LOOP_MODES.items() if m != "offload_copy"}
MODES = LOOP_MODES | TRAINER_MODES  # soak mode -> the keys of the ckpt node (layers added)
DEFAULT_MODES = [*LOOP_MODES, "trainer_full", "trainer_names"]
NOTES = {
    "offload": "on CPU the saved activations already live in host memory: offload moves nothing here",
    "offload_copy": "offload's copy path forced on CPU: every saved activation goes to a host buffer and back",
}


# ------------------------------------------------------------------------------ running

LEFT = ("tensors", "tensor_bytes", "storages", "hooks")  # compared before and after a mode


@dataclass
class Row:
    mode: str
    steps: int
    wrapped: int
    start: Snapshot  # after the warm-up
    end: Snapshot  # after the last step
    cycle_objects: int  # left in reference cycles by the last step
    cycle_tensors: int
    seconds: float  # from start to end
    before: Snapshot | None = None  # before the model was built
    after: Snapshot | None = None  # after the model, optimiser and trainer were dropped
    notes: list[str] = field(default_factory=list)

    @property
    def grew(self) -> list[str]:
        return [k for k in Snapshot.EXACT if getattr(self.end, k) > getattr(self.start, k)]

    @property
    def left(self) -> list[str]:
        if self.before is None or self.after is None:
            return []
        return [k for k in LEFT if getattr(self.after, k) > getattr(self.before, k)]


@contextlib.contextmanager
def _copy_on_cpu(on: bool) -> Iterator[None]:
    """Offloading treats no device as host memory, so CPU tensors take the copy path (only for offload_copy)."""
    if not on:
        yield
        return
    saved = Offloading._in_host_memory  # a class attribute that tests empty in a subclass
    Offloading._in_host_memory = ()
    try:
        yield
    finally:
        Offloading._in_host_memory = saved


def _batch(model: GPT, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return MODELS["gpt"].batch(model, g)


def soak_loop(mode: str, args: argparse.Namespace, bar: tqdm, live: LiveStorages) -> Row:
    """A plain training loop: forward, loss, backward, AdamW step, gradients set to None."""
    torch.manual_seed(0)
    model = GPT(**SIZES[args.size]).train()
    wrapped = len(apply_checkpointing(model, layers=LAYERS, **MODES[mode]))  # auto profiles here
    # The model's AdamW, but foreach: a few ops per step instead of ten per parameter, each of which
    # LiveStorages would see (a Python dispatch mode costs tens of microseconds per op on CPU).
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr, foreach=True)
    g = torch.Generator().manual_seed(1)

    def step() -> None:
        model.loss(_batch(model, g)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)

    cycles: dict[str, int] = {}
    for _ in range(args.warmup):
        step()
    start = Snapshot.take(model, optimizer, live)
    t0 = time.perf_counter()
    for _ in range(args.steps - 1):
        step()
    with counting_cycles(cycles):
        step()
    seconds = time.perf_counter() - t0
    end = Snapshot.take(model, optimizer, live)
    return Row(mode, args.steps, wrapped, start, end, seconds=seconds, **cycles)


class _Probe(pl.Callback):
    """Snapshots at the end of the last warm-up batch and of the last batch; counts the last batch's cycles."""

    def __init__(self, warmup: int, steps: int, live: LiveStorages, bar: tqdm) -> None:
        self.first, self.last = warmup - 1, warmup + steps - 1  # batch indices
        self.live, self.bar = live, bar
        self.snaps: list[Snapshot] = []
        self.cycles: dict[str, int] = {}
        self.times: list[float] = []  # perf_counter at the two snapshots
        self._counting = contextlib.ExitStack()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == self.last:
            self._counting.enter_context(counting_cycles(self.cycles))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        i = args[-1]  # (outputs, batch, batch_idx)
        self.bar.update(1)
        if i == self.last:
            self._counting.close()
            self.times.append(time.perf_counter())
        if i in (self.first, self.last):
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            self.snaps.append(Snapshot.take(pl_module, optimizer, self.live))
        if i == self.first:
            self.times.append(time.perf_counter())

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._counting.close()


def soak_trainer(mode: str, args: argparse.Namespace, bar: tqdm, live: LiveStorages) -> Row:
    """``Trainer.fit`` with the ``ActivationCheckpointing`` callback, on the example ``TextData``."""
    size = SIZES[args.size]
    torch.manual_seed(0)
    model = GPT(**size)
    total = args.warmup + args.trainer_steps
    data = TextData(block_size=size["block_size"], batch_size=size["batch_size"],
                    num_samples=total * size["batch_size"])
    probe = _Probe(args.warmup, args.trainer_steps, live, bar)
    ckpt = ActivationCheckpointing(layers=LAYERS, **MODES[mode])
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=total, max_epochs=1, callbacks=[ckpt, probe],
        log_every_n_steps=1,  # the callback counts saved bytes on every logged step: on every step here
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[LightningEnvironment()],  # not SLURM's, even under srun: one local process
    )
    trainer.fit(model, datamodule=data)
    (start, end), (t0, t1) = probe.snaps, probe.times
    return Row(mode, args.trainer_steps, len(ckpt.wrapped), start, end, seconds=t1 - t0, **probe.cycles)


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's per-fit info lines (devices, the wrap report, auto's plan) would bury the table."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def soak(mode: str, args: argparse.Namespace, bar: tqdm) -> Row:
    """One mode, with LiveStorages on from before its model is built until after all of it is dropped."""
    bar.set_postfix_str(mode)
    run = soak_trainer if mode in TRAINER_MODES else soak_loop
    with warnings.catch_warnings(record=True) as caught, _quiet_lightning(), _copy_on_cpu(mode == "offload_copy"):
        warnings.simplefilter("default")  # once per place: the list must not grow with the steps
        warnings.filterwarnings("ignore", message="The `srun` command is available")  # Lightning, on SLURM hosts
        with LiveStorages() as live:
            before = Snapshot.take(None, None, live)
            row = run(mode, args, bar, live)  # returns with nothing of the mode referenced but the row
            row.before, row.after = before, Snapshot.take(None, None, live)
    base = mode.removeprefix("trainer_")
    notes = [NOTES[base]] if base in NOTES else []
    row.notes = notes + [m for m in dict.fromkeys(str(w.message) for w in caught) if m != NOTHING_TO_MOVE]
    return row


# ------------------------------------------------------------------------------ output

def _arrow(a: Any, b: Any, fmt: Callable[[Any], str] = str) -> str:
    return f"{fmt(a)} → {fmt(b)}"


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f}"


def _left(r: Row) -> str:
    if r.before is None or r.after is None:
        return "?"
    d = {k: getattr(r.after, k) - getattr(r.before, k) for k in ("tensors", "tensor_bytes", "hooks")}
    return f"{d['tensors']:+} tensors, {d['tensor_bytes']:+,} B, {d['hooks']:+} hooks"


def _verdict(r: Row) -> str:
    problems = [f"GREW: {', '.join(r.grew)}"] if r.grew else []
    problems += [f"LEFT: {', '.join(r.left)}"] if r.left else []
    return "; ".join(problems) or "ok"


def table(rows: list[Row]) -> str:
    head = ("mode", "steps", "live tensors", "tensor bytes (storages)", "hooks", "stacks", "RSS MiB (noisy)",
            "cycles/step", "ms/step", "left after the mode", "")
    body = []
    for r in rows:
        s, e = r.start, r.end
        body.append((
            r.mode, str(r.steps), _arrow(s.tensors, e.tensors),
            f"{s.tensor_bytes:,} ({s.storages}) → {e.tensor_bytes:,} ({e.storages})",
            _arrow(s.hooks, e.hooks), _arrow(s.saved_hooks + s.modes, e.saved_hooks + e.modes),
            _arrow(s.rss, e.rss, _mib), f"{r.cycle_objects} ({r.cycle_tensors} tensors)",
            f"{r.seconds / r.steps * 1e3:.1f}", _left(r), _verdict(r),
        ))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    right = {1, 8}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in (head, *body)]
    return "\n".join(x.rstrip() for x in lines)


def command_line(argv: Sequence[str]) -> str:
    prog = Path(sys.argv[0]).name
    prog = "python -m ckpt_tools.soak" if prog in ("soak.py", "__main__.py", "-c", "") else prog
    return " ".join([prog, *map(shlex.quote, argv)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt-soak", description="Train the example GPT for thousands of steps in every checkpointing mode "
        "and check that live tensors, their bytes and hooks do not grow. Exit status 1 if one does.")
    parser.add_argument("--steps", type=int, default=3000, help="measured steps per mode (default 3000)")
    parser.add_argument("--trainer-steps", type=int, default=None,
                        help="measured steps of the trainer_* modes (default: --steps / 5)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the start snapshot (default 5)")
    parser.add_argument("--size", choices=list(SIZES), default="tiny",
                        help="tiny: the tests' GPT (default); quick: ckpt-bench --quick's GPT. Both have 4 blocks")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: small ops, often on a shared machine)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, from {','.join(MODES)} (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--out", type=Path, default=Path("soak.json"), help="JSON results (default soak.json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trainer_steps is None:
        args.trainer_steps = max(args.steps // 5, 1)
    for flag in ("steps", "trainer_steps", "warmup", "threads"):
        if getattr(args, flag) < 1:  # warm-up: AdamW makes its state in the first step
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not a mode; valid, closest first: {', '.join(closest_first(m, MODES))}")
    if not modes:
        parser.error(f"--modes is empty; valid: {', '.join(MODES)}")
    modes = list(dict.fromkeys(modes))

    command = command_line(argv)
    print(command, flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    total = sum(args.warmup + (args.trainer_steps if m in TRAINER_MODES else args.steps) for m in modes)
    # What exists now (imports: some 400,000 objects) leaves the collector's view: collections and the
    # snapshots' object scan take milliseconds instead of a second. What a mode makes stays in view.
    gc.collect()
    gc.freeze()
    try:
        with tqdm(total=total, desc="ckpt-soak", unit="step", file=sys.stderr) as bar:
            rows = [soak(mode, args, bar) for mode in modes]
    finally:
        gc.unfreeze()  # main() may run inside another program (the tests): leave it as it was
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t0

    print(table(rows))
    for r in rows:
        for note in r.notes:
            print(f"- {r.mode}: {note}")
    grew, left = [r.mode for r in rows if r.grew], [r.mode for r in rows if r.left]
    verdict = "; ".join(([f"GREW in {', '.join(grew)}"] if grew else [])
                        + ([f"LEFT tensors or hooks behind: {', '.join(left)}"] if left else []))
    print(f"{verdict or 'no exact measure grew in any mode, and no mode left anything behind'}; {seconds:.0f} s")
    results = {
        "command": command, "torch": torch.__version__, "threads": args.threads,
        "model": {"class": "GPT", **SIZES[args.size]}, "layers": LAYERS, "warmup": args.warmup,
        "seconds": seconds, "ok": not (grew or left),
        "modes": {r.mode: asdict(r) | {"grew": r.grew, "left": r.left, "keys": MODES[r.mode]} for r in rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if grew or left else 0


if __name__ == "__main__":
    sys.exit(main())

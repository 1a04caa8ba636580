"""One zoo model, three ways: no checkpointing, ``layers=auto``, the library's own checkpointing.

Each way builds the model afresh and runs two training steps from the same RNG
state: the first is compared (loss, every gradient, every buffer: bitwise with
the run without checkpointing), the second measured by ``MemTracker``
(``step_memory``; the first builds what a model builds lazily: rotary tables,
masks). The library's own checkpointing is only measured: a no-grad forward
stands in for its first step. Asked (``least``), a fourth way: ``ckpt=auto`` with
``ckpt.budget=min``, planned from the model's own training call. The activation
peak is README's "How we measure": each category's maximum over the step,
recomputation counted as activation. Beside them, the forward's own floor
(``measure/floor.py``), which no way of checkpointing the model goes below.
Asked (``budget=0.5``), ``ckpt=auto`` at that budget (``ZooResult.budget``): planned and
met (MemTracker under the fraction of the peak without checkpointing), or refused
with the least reachable peak, then planned and run with that peak as its budget in
bytes; with how much the process's peak resident memory grew while planning, beside
the step's whole peak (MemTracker's total). A forward fake tensors cannot run is
refused by name (``NotFakeable``) and has no run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ckpt_plugin import apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin._compat import hook_count
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.floor import forward_floor
from ckpt_plugin.measure.memory import step_memory
from ckpt_plugin.measure.values import ValueRecord, recorded_values
from ckpt_tools.workloads import peak_growth
from ckpt_tools.zoo import ZooModel


@dataclass
class Run:
    """What one way of training a zoo model gave."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    act_peak: int  # bytes, MemTracker's activation category (recomputation included)
    total_peak: int = 0  # bytes, MemTracker's whole step (parameters, gradients, activations, temporaries)


@dataclass
class BudgetResult:
    """``ckpt=auto`` at one budget, planned from the model's own training call: met, or refused and run at the least."""

    asked: str  # the budget as typed: "0.5"
    limit: int = 0  # bytes the step's activation peak must stay under: the fraction of none's, or the refusal's least
    refused: str | None = None  # None: planned at ``asked``; else "NotFakeable (...)" or "least 0.52" (over none's)
    least: int | None = None  # the refusal's least reachable peak in bytes (``Problem.least``): the rerun's budget
    run: Run | None = None  # the step with the plan (at ``asked``, or after a refusal at ``least`` bytes)
    mismatches: list[str] = field(default_factory=list)  # against the step without checkpointing
    planning_peak: int | None = None  # bytes the process's peak RSS grew while planning that run (Linux; else None)
    values: ValueRecord | None = None  # what a forward that reads values read, recorded for planning (None: no read)

    @property
    def met(self) -> bool:
        """The run's activation peak (MemTracker) within ``limit``, its step bitwise."""
        return self.run is not None and self.run.act_peak <= self.limit and not self.mismatches


@dataclass
class ZooResult:
    entry: ZooModel
    note: str  # what ckpt.layers=auto said it chose
    wrapped: list[str]
    none: Run
    ours: Run
    own: Run | None
    names_kept: bool  # parameter, buffer and module names as without the plugin
    restored: bool  # remove_checkpointing unwrapped what it wrapped: forwards and hooks as the plain model's
    mismatches: list[str] = field(default_factory=list)  # gradients/buffers/loss not bitwise equal
    floor: int | None = None  # the forward's own floor (measure/floor.py); None: the model cannot run on fake tensors
    least: Run | None = None  # ckpt=auto with ckpt.budget=min on the chosen layers (measure(least=True)); None: not run
    least_mismatches: list[str] = field(default_factory=list)
    above: Run | None = None  # ckpt=auto with a budget of ABOVE times min's peak, in bytes (with least)
    above_budget: int = 0
    above_mismatches: list[str] = field(default_factory=list)
    budget: BudgetResult | None = None  # ckpt=auto at measure(budget=...); None: not asked

    @property
    def above_met(self) -> bool:
        """The budget above min's peak held (MemTracker) and the step bitwise."""
        return self.above is not None and self.above.act_peak <= self.above_budget and not self.above_mismatches

    @property
    def ours_over_own(self) -> float | None:
        return self.ours.act_peak / self.own.act_peak if self.own else None


def _names(model: nn.Module) -> tuple[list[str], ...]:
    return ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()],
            [n for n, _ in model.named_modules()])


def _calls(model: nn.Module) -> dict[str, tuple]:
    """How each module is called: whether by an instance-level forward, and how many hooks it has
    (a model may add its own in its first forward: transformers' output recorders do)."""
    return {n: ("forward" in m.__dict__, hook_count(m)) for n, m in model.named_modules()}


def _cache_off(model: nn.Module) -> nn.Module:
    """``use_cache=False`` in every Hugging Face config of ``model``, as a checkpointed training call runs.

    The plugin (as HF's own ``gradient_checkpointing_enable()``) runs a model above
    checkpointed layers with its KV cache off in training. A filled cache hands
    attention contiguous copies of the keys where the uncached call hands it a
    transposed view: the same values, but MKL's matmul rounds the two layouts
    differently on some CPUs (GPT-2 and T5 differ from the cached call by up to
    7e-9 on an AMD EPYC with AVX-512, not at all under ``MKL_CBWR=COMPATIBLE``:
    ``tests/test_t5_cache.py``, pytorch#104439).
    So the baseline a bitwise comparison is made against is the same call with
    the cache off (T5's decoder has a config of its own: every module's is set).
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False
    return model


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)  # Wav2Vec2's and HuBERT's training-time masking (SpecAugment) draws from numpy


def _train(entry: ZooModel, model: nn.Module, compared: bool = True) -> Run:
    _seed(1)
    if compared:
        loss = entry.step(model).detach()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        model.zero_grad(set_to_none=True)
    else:  # a forward alone builds what the model builds lazily; nothing of this run is compared
        with torch.no_grad():
            loss, grads, buffers = entry.loss(model(**entry.batch())).detach(), {}, {}
    _seed(2)
    peaks = step_memory(lambda: entry.step(model), model)
    model.zero_grad(set_to_none=True)
    return Run(loss, grads, buffers, peaks["act"], peaks["total"])


def _differences(a: Run, b: Run) -> list[str]:
    out = [] if torch.equal(a.loss, b.loss) else ["loss"]
    for kind, x, y in (("grad", a.grads, b.grads), ("buffer", a.buffers, b.buffers)):
        if x.keys() != y.keys():
            out.append(f"{kind} names")
        out += [f"{kind} {n}" for n in x if n in y and not torch.equal(x[n], y[n])]
    return out


ABOVE = 1.1  # the budget above min's peak a plan must meet: 10 % more bytes


def _planned(entry: ZooModel, budget: str) -> Run | None:
    """A step with ``ckpt=auto`` planned for ``budget`` (``layers=auto``) from the model's own training call; None
    where its forward cannot run on fake tensors (refused by name: ``NotFakeable``)."""
    try:
        return _plan_and_train(entry, budget)[0]
    except NotFakeable:
        return None


def _plan_and_train(entry: ZooModel, budget: str) -> tuple[Run, int | None, ValueRecord | None]:
    """A fresh model planned by ``ckpt=auto`` at ``budget`` (``layers=auto``) from its own training call, then one
    compared step; how much the process's peak RSS grew while planning, and what planning recorded of a forward
    that reads values (``measure/values.py``). Raises what planning raises."""
    model = entry.build()
    plan, grown = peak_growth(lambda: plan_for(model, make_config(layers="auto", mode="auto", budget=budget),
                                               lambda: entry.loss(model(**entry.batch()))))
    install(model, plan)
    return _train(entry, model), grown, recorded_values(model)


def at_budget(entry: ZooModel, fraction: float, none: Run) -> BudgetResult:
    """``ckpt=auto ckpt.budget=<fraction>``: met, or refused; a refusal that names the least reachable peak is then
    planned and run with that peak as the budget in bytes (a value the error says is reachable: it must be met).
    Raises ``NotFakeable`` where the forward cannot run on fake tensors (:func:`measure` says so in a row)."""
    asked = f"{fraction:g}"
    try:
        run, grown, values = _plan_and_train(entry, asked)
        return _checked(BudgetResult(asked, int(fraction * none.act_peak), run=run, planning_peak=grown,
                                     values=values), none)
    except ConfigError as err:
        least = next((p.least for p in err.problems if p.least is not None), None)
        if least is None:
            raise
    run, grown, values = _plan_and_train(entry, f"{least}B")
    return _checked(BudgetResult(asked, least, f"least {least / none.act_peak:.2f}", least, run, planning_peak=grown,
                                 values=values), none)


def _at_budget_or_refused(entry: ZooModel, fraction: float, none: Run) -> BudgetResult:
    try:
        return at_budget(entry, fraction, none)
    except (NotFakeable, ConfigError) as err:  # reads tensor values fake tensors have none of (measure/fake.py)
        cause = err if isinstance(err, NotFakeable) else err.__cause__  # planning's ConfigError names it as its cause
        if not isinstance(cause, NotFakeable):
            raise
        return BudgetResult(f"{fraction:g}", refused=f"NotFakeable ({str(cause).split('cannot run on them: ', 1)[-1]})")


def _checked(result: BudgetResult, none: Run) -> BudgetResult:
    result.mismatches = _differences(none, result.run)
    return result


def measure(entry: ZooModel, least: bool = False, budget: float | None = None) -> ZooResult:
    """``least``: also train with ``ckpt=auto``'s least peak (``ZooResult.least``), and with a budget 10 % above
    it (``ZooResult.above``: a budget the planner can reach must be met). ``budget`` (a fraction, 0.5): also
    ``ckpt=auto`` at it, or at the least peak its refusal names (``ZooResult.budget``, :func:`at_budget`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's config notes and "use_cache=False" advice: known here
        plain = _cache_off(entry.build())
        none = _train(entry, plain)
        try:
            floor = forward_floor(plain, lambda: entry.loss(plain(**entry.batch()))).bytes
        except NotFakeable:
            floor = None
        model = entry.build()
        before = _names(model)
        note = plan_for(model, make_config(layers="auto")).note
        wrapped = apply_checkpointing(model, layers="auto")
        ours = _train(entry, model)
        names_kept = _names(model) == before
        removed = remove_checkpointing(model)
        restored = removed == wrapped and not wrapped_modules(model) and _calls(model) == _calls(plain)
        own = None
        if entry.own is not None:
            theirs = entry.build()
            rebuilt = entry.own(theirs)
            theirs = theirs if rebuilt is None else rebuilt
            own = _train(entry, theirs, compared=False)
        planned = _planned(entry, "min") if least else None
        above_budget = int(ABOVE * planned.act_peak) if planned else 0
        above = _planned(entry, f"{above_budget}B") if planned else None
        halved = _at_budget_or_refused(entry, budget, none) if budget is not None else None
    return ZooResult(entry, note, wrapped, none, ours, own, names_kept, restored, _differences(none, ours), floor,
                     planned, _differences(none, planned) if planned else [], above, above_budget,
                     _differences(none, above) if above else [], halved)


__all__ = ["BudgetResult", "Run", "ZooResult", "at_budget", "measure"]

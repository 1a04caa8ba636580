"""A plan as plain JSON: written once it is installed, given back with ``ckpt.plan``, broadcast to every rank.

    save_plan(plan, "ckpt_plan.json", model)     # what ckpt=auto chose, with what it names
    plan = load_plan("ckpt_plan.json", model)    # checked against model: a WrapPlan to install

    python recipes/train.py ckpt=auto ckpt.plan=outputs/.../ckpt_plan.json   # rerun it, without planning

A file holds each group of the :class:`~ckpt_plugin.engine.plan.WrapPlan`
(its module names, its treatment as keys, its compile backend, its segments:
a count, a word, or the nested regions of a planned schedule), the modules it
regroups, its note, the planner's own account (``planned``: predicted peak,
time and each layer's option) for the report, the plugin's and torch's
versions, and the class of every module it names. A selective policy is kept
as the spec it was built from (``matmuls``, a list of aten op names, or
``names`` with ``save_names``/``exclude_names``) and built again by
``make_policy`` on loading, so an op this torch lacks is an error then, not a
silent difference.

Giving a plan back checks it against the model first: a format this plugin
does not read, a name that is no module (closest existing names first) or a
module of another class is a :class:`~ckpt_plugin.errors.ConfigError` on
``ckpt.plan`` naming the file. A treatment with DeepSpeed's own checkpoint
(``checkpoint_fn``) is refused when saving: a function cannot be written, and
losing it would install torch's checkpoint instead, silently.

Lives in ``planning/`` because it rebuilds the planner's records (``Plan``,
rotor's ``Solution``); the engine's plan knows nothing of files.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_plugin import __version__
from ckpt_plugin._compat import user_module
from ckpt_plugin.engine.op_groups import is_regrouped, regroup, ungroup
from ckpt_plugin.engine.plan import EachLayer, Group, Segments, WrapPlan
from ckpt_plugin.engine.selective.policies import make_policy
from ckpt_plugin.engine.segments.sequential import Node, Region
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.errors import ConfigError, Problem, closest_first
from ckpt_plugin.planning.options import parse
from ckpt_plugin.planning.planner import Plan
from ckpt_plugin.planning.rotor import Solution

FORMAT = 1  # what this plugin writes and reads; a file of another format is refused, naming both
KEY = "ckpt.plan"
FILE_NAME = "ckpt_plan.json"  # what a run that planned writes in the Trainer's log dir
_SHOWN = 3  # how many differing names an error lists before "..."


# ---------------------------------------------------------------------- to plain data

def plan_to_dict(plan: WrapPlan, model: nn.Module) -> dict[str, Any]:
    """``plan`` as JSON-ready data, with the class of every module it names in ``model``."""
    model = user_module(model)
    with _modules(model, plan.regroup, "this plan") as modules:
        named = [*plan.regroup, *plan.names]
        missing = [n for n in named if n not in modules]
        if missing:
            raise ValueError(f"the plan names {', '.join(map(repr, missing))}, not modules of {type(model).__name__}")
        classes = {name: type(modules[name]).__name__ for name in dict.fromkeys(named)}
    return {
        "format": FORMAT,
        "plugin": __version__,
        "torch": str(torch.__version__),  # a TorchVersion would not load with weights_only=True
        "model": type(model).__name__,
        "groups": [_group_to_dict(g) for g in plan.groups],
        "regroup": list(plan.regroup),
        "note": plan.note,
        "planned": _planned_to_dict(plan.planned),
        "modules": classes,
    }


def _group_to_dict(group: Group) -> dict[str, Any]:
    out: dict[str, Any] = {"names": list(group.names), "treatment": _treatment_to_dict(group.treatment)}
    if isinstance(group, Segments):
        segments = group.segments
        out["segments"] = [_node(n) for n in segments] if isinstance(segments, tuple | list) else segments
    else:
        out["compile"] = group.compile
    return out


def _treatment_to_dict(treatment: Treatment) -> dict[str, Any]:
    if treatment.checkpoint_fn is not None:
        raise ConfigError([Problem(
            KEY, "a plan with DeepSpeed's own checkpoint (ckpt.deepspeed: a checkpoint_fn) cannot be written to a "
            "plan file: a function is not data, and leaving it out would install torch's checkpoint instead",
            "give the run its ckpt.deepspeed keys again instead of a plan file")])
    policy = treatment.policy
    return {
        "checkpointing": treatment.checkpointing,
        "preserve_rng_state": treatment.preserve_rng_state,
        "policy": None if policy is None else {
            "policy": list(policy.policy) if isinstance(policy.policy, tuple | list) else policy.policy,
            "save_names": None if policy.save_names is None else list(policy.save_names),
            "exclude_names": None if policy.exclude_names is None else list(policy.exclude_names),
        },
        "offload": treatment.offload,
        "check_recompute": treatment.check_recompute,
    }


def _node(node: Node) -> Any:
    return node if isinstance(node, int) else {"start": node.start, "stop": node.stop,
                                                 "children": [_node(c) for c in node.children]}


def _planned_to_dict(planned: Any) -> dict[str, Any] | None:
    """The planner's record: ckpt=auto's ``Plan`` or rotor's ``Solution`` (segments=optimal, nested regions)."""
    if planned is None:
        return None
    if isinstance(planned, Plan):  # its options by their names, as plans print them
        return {"type": "Plan", **plain(asdict(planned) | {"choices": {n: str(o) for n, o in planned.choices.items()},
                                                           "keys": [str(o) for o in planned.keys]})}
    if isinstance(planned, Solution):
        return {"type": "Solution", "schedule": [_node(n) for n in planned.schedule],
                "recompute_flops": planned.recompute_flops, "predicted_peak": planned.predicted_peak,
                "limit": planned.limit, "least_peak": planned.least_peak, "names": list(planned.names)}
    raise TypeError(f"a plan's planned record is a Plan or a Solution, not {type(planned).__name__}")


def plain(value: Any) -> Any:
    """Tuples as lists, through dicts and lists: what JSON gives back, so a dict compares equal to its file
    (and what a Lightning checkpoint stores of the callback's keys)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def save_plan(plan: WrapPlan, path: str | os.PathLike, model: nn.Module) -> Path:
    """Write ``plan`` (of ``model``) to ``path`` as JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    text = json.dumps(plan_to_dict(plan, model), indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text + "\n")
    os.replace(partial, path)
    return path


# ---------------------------------------------------------------------- back to a plan

def load_plan(path: str | os.PathLike, model: nn.Module) -> WrapPlan:
    """The plan in ``path``, checked against ``model``; a ConfigError on ``ckpt.plan`` naming the file otherwise."""
    source = f"ckpt.plan={os.fspath(path)}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError([Problem(KEY, f"{source}: no such file", "give the path of a ckpt_plan.json that a "
                                   "ckpt=auto run wrote (in its log dir)")]) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError([Problem(KEY, f"{source} is not a plan file: {err}")]) from err
    return plan_from_dict(data, model, source)


def plan_from_dict(data: Any, model: nn.Module, source: str = "the plan") -> WrapPlan:
    """The :class:`WrapPlan` that ``data`` (:func:`plan_to_dict`'s) describes, checked against ``model``.

    ``source`` says where the data came from, in errors (``ckpt.plan=path``, the checkpoint, rank 0).
    """
    if not isinstance(data, dict) or "format" not in data:
        raise ConfigError([Problem(KEY, f"{source} is not a plan file (a JSON object with a 'format' key, "
                                   "as ckpt=auto writes it)")])
    if data["format"] != FORMAT:
        raise ConfigError([Problem(
            KEY, f"{source} is a plan file of format {data['format']!r}, written by ckpt_plugin "
            f"{data.get('plugin', '(unknown)')}; this ckpt_plugin {__version__} reads format {FORMAT}",
            "plan again with this version (ckpt=auto without ckpt.plan) and keep its ckpt_plan.json")])
    try:
        treatments: dict[str, Treatment] = {}  # equal treatments are one object, as the planner shares them
        groups = tuple(_group_from_dict(g, treatments) for g in data["groups"])
        plan = WrapPlan(groups, planned=_planned_from_dict(data.get("planned")), note=data.get("note", ""),
                        regroup=tuple(data.get("regroup", ())))
        classes = dict(data["modules"])
    except ConfigError as err:  # a policy this torch cannot build: its problem, said of the file
        raise ConfigError([Problem(KEY, f"{source}: {p}") for p in err.problems]) from err
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError([Problem(KEY, f"{source} is not a plan file this plugin wrote: {err!r}")]) from err
    check_against(plan, classes, model, source)
    return plan


def _group_from_dict(data: dict[str, Any], treatments: dict[str, Treatment]) -> Group:
    names = tuple(data["names"])
    key = json.dumps(data["treatment"], sort_keys=True)
    if key not in treatments:
        treatments[key] = _treatment_from_dict(data["treatment"])
    treatment = treatments[key]
    if "segments" in data:
        segments = data["segments"]
        return Segments(names, tuple(_region(n) for n in segments) if isinstance(segments, list) else segments,
                        treatment)
    return EachLayer(names, treatment, compile=data.get("compile"))


def _treatment_from_dict(data: dict[str, Any]) -> Treatment:
    spec = data.get("policy")
    policy = None if spec is None else make_policy(
        spec["policy"], save_names=spec.get("save_names"), exclude_names=spec.get("exclude_names"))
    return Treatment(checkpointing=bool(data["checkpointing"]), preserve_rng_state=bool(data["preserve_rng_state"]),
                     policy=policy, offload=bool(data["offload"]), check_recompute=bool(data["check_recompute"]))


def _region(node: Any) -> Node:
    if isinstance(node, int):
        return node
    return Region(int(node["start"]), int(node["stop"]), tuple(_region(c) for c in node["children"]))


def _planned_from_dict(data: dict[str, Any] | None) -> Any:
    if data is None:
        return None
    data = dict(data)
    kind = data.pop("type")
    if kind == "Plan":
        return Plan(**{**data, "choices": {n: parse(o) for n, o in data["choices"].items()},
                       "rows": [tuple(r) for r in data["rows"]], "keys": tuple(parse(o) for o in data["keys"])})
    if kind == "Solution":
        return Solution(**{**data, "schedule": tuple(_region(n) for n in data["schedule"]),
                           "names": tuple(data["names"])})
    raise ValueError(f"unknown planned record {kind!r}")


# ---------------------------------------------------------------------- the check

def check_against(plan: WrapPlan, classes: dict[str, str], model: nn.Module, source: str) -> None:
    """Raise a ConfigError on ``ckpt.plan`` if ``plan`` names a module ``model`` lacks, or one of another class
    than ``classes`` (name -> class name, as saved) records. Leaves ``model`` as it was."""
    model = user_module(model)
    existing = dict(model.named_modules())
    not_there = [n for n in plan.regroup if n not in existing]
    if not_there:  # checked first: the op groups inside a module that is not there cannot be made
        raise ConfigError([_unknown(not_there, existing, model, source)])
    with _modules(model, plan.regroup, source) as modules:
        problems = []
        missing = [n for n in dict.fromkeys([*plan.regroup, *plan.names, *classes]) if n not in modules]
        if missing:
            problems.append(_unknown(missing, modules, model, source))
        other = [(n, want, type(modules[n]).__name__) for n, want in classes.items()
                 if n in modules and type(modules[n]).__name__ != want]
        if other:
            shown = ", ".join(f"{n} is a {got}, the plan's a {want}" for n, want, got in other[:_SHOWN])
            problems.append(Problem(
                KEY, f"{source} was made for another model: {len(other)} module(s) of another class in "
                f"{type(model).__name__}: {shown}{', ...' if len(other) > _SHOWN else ''}",
                "plan again for this model (ckpt=auto without ckpt.plan)"))
    if problems:
        raise ConfigError(problems)


def _unknown(missing: list[str], modules: dict[str, nn.Module], model: nn.Module, source: str) -> Problem:
    names = [n for n in modules if n]
    near = "; ".join(f"{n}: {', '.join(closest_first(n, names)[:3])}" for n in missing[:_SHOWN])
    more = f", ... ({len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""
    return Problem(KEY, f"{source} names {len(missing)} module(s) that {type(model).__name__} does not have: "
                   f"{', '.join(missing[:_SHOWN])}{more}",
                   f"module names, closest first: {near}; plan again for this model (ckpt=auto without ckpt.plan)")


@contextlib.contextmanager
def _modules(model: nn.Module, regrouped: tuple[str, ...], source: str) -> Iterator[dict[str, nn.Module]]:
    """The model's modules with ``regrouped``'s op groups among them (``op_groups.py``), as ``install`` makes
    them; the modules regrouped here are ungrouped again on leaving."""
    modules = dict(model.named_modules())
    made = []
    try:
        for name in regrouped:
            module = modules.get(name)
            if module is not None and not is_regrouped(module):
                if not regroup(module):
                    raise ConfigError([Problem(KEY, f"{source} runs {name} as op groups, and its forward has "
                                               "none here (op_groups.py): another model, or another forward")])
                made.append(module)
        yield dict(model.named_modules())
    finally:
        for module in made:
            ungroup(module)


__all__ = ["FILE_NAME", "FORMAT", "check_against", "load_plan", "plain", "plan_from_dict", "plan_to_dict", "save_plan"]

"""Parts inside a layer's own ``forward``: its chains of ops, traced and cut into modules the planner can wrap.

A layer's child modules are not always where its memory can be split. The
example ResNet's ``Bottleneck`` calls ``conv1``, ``bn1``, ``F.relu``,
``conv2``... in its ``forward``: checkpointing any one of them keeps what it
kept (a convolution keeps its input either way), and the functional ReLUs
belong to no module at all. What does split it is a region over several
consecutive ops (``conv -> norm -> act``, the unit timm's ``ConvNormAct`` and
torchvision's ``Conv2dNormActivation`` name), so that it keeps its input only.

:func:`op_groups` traces a module's ``forward`` with ``torch.fx`` (every child
module a leaf: their insides are not touched), finds its *chains* (ops each of
which takes only the previous one's output, the previous one used by nothing
else) and cuts each after every activation into *units*. A chain of two or more
units becomes a left-deep tree of :class:`OpGroup` modules: its head (every
unit but the last, itself such a tree down to the first unit) and its last
unit, so that a region over the last unit keeps only the head's output while
the head is recomputed on its own, later, in backward (the nesting Rotor's
schedules take at their least memory). :func:`regroup` registers the groups as
children of the module and gives it an instance-level ``forward`` that runs the
traced graph as a plain-data program (:class:`_Program`), the groups in place
of the chains' ops; :func:`ungroup` takes both away.

What stays exactly as it was: the ops, their order and their arguments (the
program runs what the ``forward`` runs, so gradients are bitwise equal),
``state_dict`` and ``named_parameters`` (a group owns no parameter and no
buffer: it calls its layer's modules without registering them), and every
call the trace does not describe. A traced graph fixes what Python decided
while tracing: the module's ``training`` flag, the number of arguments, and that
each is a tensor (``mask is None`` is False for a traced argument). A call in the
other mode, with keywords, another number of arguments or one that is not a
tensor runs the module's own ``forward`` (the groups then run nowhere: correct,
only without their regions); ``ckpt=auto`` regroups a layer only if its groups
ran in the step it profiles.
A ``forward`` that does not trace (control flow on tensors, ``*args``), that
reads a parameter or buffer of its own (``get_attr``: a layer scale), or whose
chains have one unit each, gets no groups: its child modules are its parts, as before.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ckpt_plugin.engine.forwards import instance_forward, set_forward

ATTR = "_ckpt_plugin_op_groups"  # where a regrouped module keeps its Regrouped (instance __dict__, not state)

# What ends a unit: the activation of a conv-norm-act (or linear-act). Functions, methods and modules.
_ACTIVATION_FUNCTIONS = {
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.leaky_relu, F.hardswish, F.hardsigmoid,
    F.hardtanh, F.softplus, F.sigmoid, F.tanh, torch.relu, torch.sigmoid, torch.tanh,
}
_ACTIVATION_METHODS = {"relu", "sigmoid", "tanh"}
_ACTIVATION_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.SELU, nn.CELU, nn.LeakyReLU, nn.Hardswish,
    nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Sigmoid, nn.Tanh, nn.PReLU,
)


class _Leaves(torch.fx.Tracer):
    """Every child module is a leaf: the trace is this module's own forward, one level deep."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


# One op of a unit: what it calls (a module of the layer, a function, a Tensor method) and its arguments
# after the first, which is always the previous op's output (the unit's input for its first op).
_Op = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class OpGroup(nn.Module):
    """A run of consecutive ops of its layer's ``forward`` (a unit), or a head and a unit (``children``).

    It owns nothing: a unit calls its layer's modules from a plain tuple (not
    ``_modules``), so no key of ``state_dict`` and no parameter is added.
    """

    def __init__(self, names: tuple[str, ...], ops: tuple[_Op, ...] = ()) -> None:
        super().__init__()
        self.__dict__["ops"] = names  # the traced nodes' names, in order (no attribute a child's name can clash with)
        self.__dict__["_ops"] = ops  # (): call the children (head, last unit) in turn

    def forward(self, x: torch.Tensor) -> Any:
        for fn, args, kwargs in self.__dict__["_ops"]:
            x = fn(x, *args, **kwargs)
        for child in self.children():
            x = child(x)
        return x

    def calls(self) -> list[nn.Module]:
        """The modules of its layer that it calls (for ``norms.running_stats``: BatchNorms recomputed)."""
        own = [fn for fn, _, _ in self.__dict__["_ops"] if isinstance(fn, nn.Module)]
        return own + [m for child in self.children() if isinstance(child, OpGroup) for m in child.calls()]

    def extra_repr(self) -> str:
        return f"ops={', '.join(self.ops)}"


@dataclass
class Regrouped:
    """What :func:`regroup` did to one module: its groups (in call order) and the forward it installed."""

    groups: dict[str, OpGroup]  # child name -> top-level group
    parts: list[str]  # the child names its traced forward calls directly, in call order
    forward: TracedForward


class TracedForward:
    """The instance-level ``forward`` of a regrouped module: its traced graph, groups in place of chains."""

    def __init__(self, module: nn.Module, run: _Program, training: bool) -> None:
        self.previous = instance_forward(module)  # None: the class's forward
        self.inner: Callable[..., Any] = module.forward
        self.run, self.training, self.module = run, training, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The trace took every parameter for a tensor (``mask is None`` was False then) in one mode.
        if (kwargs or len(args) != self.run.arity or self.module.training != self.training
                or not all(isinstance(a, torch.Tensor) for a in args)):
            return self.inner(*args, **kwargs)  # a call the trace does not describe
        return self.run(*args)


def _is_activation(node: torch.fx.Node, root: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target in _ACTIVATION_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ACTIVATION_METHODS
    return node.op == "call_module" and isinstance(root.get_submodule(node.target), _ACTIVATION_MODULES)


def _chains(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Maximal runs of ops where each takes the previous one's output as its first argument and no other
    value of the graph, the previous one used by it alone."""
    ops = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    chains: list[list[torch.fx.Node]] = []
    for node in ops:
        last = chains[-1][-1] if chains else None
        if last is not None and _takes(node, last) and list(last.users) == [node]:
            chains[-1].append(node)
        else:
            chains.append([node])
    return chains


def _takes(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether ``value`` is ``node``'s first argument and the only value of the graph it takes."""
    return bool(node.args) and node.args[0] is value and node.all_input_nodes == [value]


def _units(chain: list[torch.fx.Node], root: nn.Module) -> list[list[torch.fx.Node]]:
    """``chain`` cut after every activation (the last unit may end without one)."""
    units: list[list[torch.fx.Node]] = [[]]
    for node in chain:
        units[-1].append(node)
        if _is_activation(node, root):
            units.append([])
    return [u for u in units if u]


def _unit_ops(root: nn.Module, nodes: list[torch.fx.Node]) -> tuple[_Op, ...]:
    """What a unit calls: each node's module, function or method, with its arguments after the first."""
    return tuple((_callee(root, node), tuple(node.args[1:]), dict(node.kwargs)) for node in nodes)


def _tree(root: nn.Module, units: list[list[torch.fx.Node]]) -> OpGroup:
    """The left-deep tree over ``units``: a head (every unit but the last) and the last unit."""
    if len(units) == 1:
        return OpGroup(tuple(n.name for n in units[0]), _unit_ops(root, units[0]))
    group = OpGroup(tuple(n.name for u in units for n in u))
    head, last = _tree(root, units[:-1]), _tree(root, units[-1:])
    group.add_module(_name(head), head)
    group.add_module(_name(last), last)
    return group


def _name(group: OpGroup) -> str:
    """A group's name: its first and last op, ``conv1-relu_1`` (``fc2-fc2``: one op). The traced nodes' names are
    identifiers, unique in their graph, so the dash keeps it apart from every attribute of a module."""
    return f"{group.ops[0]}-{group.ops[-1]}"


def _trace(module: nn.Module) -> torch.fx.Graph | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _Leaves().trace(module)
    except Exception:  # noqa: BLE001 -- any forward may refuse a symbolic trace; then it has no groups
        return None


def op_groups(module: nn.Module) -> Regrouped | None:
    """Groups for the chains of ``module``'s own forward, or None (see the module docstring for when)."""
    if ATTR in module.__dict__:
        return module.__dict__[ATTR]
    graph = _trace(module)
    if graph is None:
        return None
    try:
        return _regrouped(module, graph)
    finally:
        del graph
        # torch.fx's tracer leaves reference cycles (its closures and the tracer); collected young,
        # a profile that traces every layer does not pile them up until a full collection.
        gc.collect(1)


def _regrouped(module: nn.Module, graph: torch.fx.Graph) -> Regrouped | None:
    """:func:`op_groups` for ``module`` traced as ``graph``."""
    if any(n.op == "get_attr" for n in graph.nodes):
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    trees: dict[torch.fx.Node, tuple[OpGroup, OpGroup]] = {}  # a chain's last node -> its head and last unit
    chains: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for chain in _chains(graph):
        units = _units(chain, module)
        if len(units) >= 2 and chain[0].all_input_nodes and _takes(chain[0], chain[0].all_input_nodes[0]):
            trees[chain[-1]] = (_tree(module, units[:-1]), _tree(module, units[-1:]))
            chains[chain[-1]] = chain
    if not trees:
        return None
    groups = {_name(group): group for pair in trees.values() for group in pair}
    if len(groups) != 2 * len(trees) or any(hasattr(module, name) for name in groups):
        return None  # a name its forward already uses
    # The module's graph with each chain replaced by its head's call and its last unit's, as a program.
    index = {node: i for i, node in enumerate(placeholders)}
    steps: list[_Op] = []
    skipped = {n for chain in chains.values() for n in chain}
    calls: list[str] = []
    for node in graph.nodes:
        if node in trees:
            value = _Value(index[chains[node][0].all_input_nodes[0]])
            for group in trees[node]:
                steps.append((group, (value,), {}))
                value = _Value(len(placeholders) + len(steps) - 1)
                calls.append(_name(group))
            index[node] = value.index
        elif node.op in ("call_module", "call_function", "call_method") and node not in skipped:
            ref = lambda n: _Value(index[n])  # noqa: E731
            steps.append((_callee(module, node), torch.fx.node.map_arg(node.args, ref),
                          torch.fx.node.map_arg(node.kwargs, ref)))
            index[node] = len(placeholders) + len(steps) - 1
            if node.op == "call_module":
                calls.append(node.target)
        elif node.op == "output":
            output = torch.fx.node.map_arg(node.args[0], lambda n: _Value(index[n]))
    program = _Program(tuple(steps), len(placeholders), output)
    return Regrouped(groups, list(dict.fromkeys(calls)), TracedForward(module, program, module.training))


@dataclass(frozen=True)
class _Value:
    """In a :class:`_Program`'s arguments: the value its argument or step ``index`` made."""

    index: int


class _Method:
    """A traced ``call_method``: ``obj.name(*args, **kwargs)`` (picklable, unlike a lambda)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.name)(*args, **kwargs)


def _callee(module: nn.Module, node: torch.fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        return module.get_submodule(node.target)
    return _Method(node.target) if node.op == "call_method" else node.target


class _Program:
    """A traced forward as plain data: steps (what to call, on which earlier values), run in order.

    Plain data rather than a ``torch.fx.GraphModule``: it deep-copies and pickles with its
    module, generates no code, and frees each value after its last use, as the graph does.
    """

    def __init__(self, steps: tuple[_Op, ...], arity: int, output: Any) -> None:
        self.steps, self.arity, self.output = steps, arity, output
        last: dict[int, int] = {}
        for i, (_, args, kwargs) in enumerate(steps):
            for ref in _refs((args, kwargs)):
                last[ref] = i
        kept = set(_refs(self.output))
        self.frees = tuple(tuple(r for r, at in last.items() if at == i and r not in kept) for i in range(len(steps)))

    def __call__(self, *args: Any) -> Any:
        values: list[Any] = [*args, *([None] * len(self.steps))]
        for i, (fn, a, k) in enumerate(self.steps):
            values[self.arity + i] = fn(*_load(a, values), **_load(k, values))
            for ref in self.frees[i]:
                values[ref] = None
        return _load(self.output, values)


def _load(value: Any, values: list[Any]) -> Any:
    """``value`` with every :class:`_Value` in it replaced by what it refers to."""
    return _map(value, lambda ref: values[ref.index])


def _refs(value: Any) -> list[int]:
    """The indices of the :class:`_Value` s in ``value``."""
    found: list[int] = []
    _map(value, lambda ref: found.append(ref.index))
    return found


def _map(value: Any, fn: Callable[[_Value], Any]) -> Any:
    """``value`` (nested tuples, lists, dicts and slices, as a traced op's arguments) with ``fn`` applied
    to every :class:`_Value` in it."""
    if isinstance(value, _Value):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_map(value.start, fn), _map(value.stop, fn), _map(value.step, fn))
    return value


def regroup(module: nn.Module) -> bool:
    """Give ``module`` its op groups (children) and the forward that calls them; False where it has none."""
    if ATTR in module.__dict__:
        return True
    found = op_groups(module)
    if found is None:
        return False
    for name, group in found.groups.items():
        module.add_module(name, group)
    set_forward(module, found.forward)
    module.__dict__[ATTR] = found
    return True


def ungroup(module: nn.Module) -> None:
    """Undo :func:`regroup` (nothing if it was not regrouped). Its wrapping must be taken off first."""
    found: Regrouped | None = module.__dict__.pop(ATTR, None)
    if found is None:
        return
    for name in found.groups:
        delattr(module, name)
    set_forward(module, found.forward.previous)


def regrouped(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that :func:`regroup` regrouped."""
    return [m for m in model.modules() if is_regrouped(m)]


def is_regrouped(module: nn.Module) -> bool:
    return ATTR in module.__dict__


def top_groups(module: nn.Module) -> list[str]:
    """The names of the op groups a regrouped ``module`` calls directly ([] if not regrouped)."""
    found: Regrouped | None = module.__dict__.get(ATTR)
    return list(found.groups) if found is not None else []


def parts(module: nn.Module) -> list[str] | None:
    """The children a regrouped ``module``'s forward calls directly, in call order; None if not regrouped."""
    found: Regrouped | None = module.__dict__.get(ATTR)
    if found is not None:
        return found.parts
    if isinstance(module, OpGroup):
        return [name for name, _ in module.named_children()]
    return None


__all__ = ["ATTR", "OpGroup", "Regrouped", "is_regrouped", "op_groups", "parts", "regroup", "regrouped", "top_groups", "ungroup"]

"""One module replaces a module's ``forward`` (``engine/forwards.py``), and it restores exactly (issue #32).

A. Read from the source (AST over every ``.py`` of ``ckpt_plugin/``): no module
   but ``engine/forwards.py`` assigns or deletes an object's ``forward``, in any
   of the ways Python allows (``x.forward = f``, ``x.__dict__["forward"] = f``,
   ``del``, ``pop``, ``setattr``, ``object.__setattr__``, ...).
B. ``TemporaryForwards`` gives back the very object each module had (or no forward
   of its own) on a normal exit, on an exception inside the block or while it
   replaces, nested, replaced twice, and around a checkpoint wrapper ``install``
   put there, whose model computes exactly what it computed. The measuring that
   uses it (profiling, ``checkpointing_disabled``, op groups) leaves the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import gpt_batch, small_gpt, small_resnet
from torch import nn

from ckpt_plugin import apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin.engine.forwards import TemporaryForwards, instance_forward, set_forward
from ckpt_plugin.engine.op_groups import regroup, ungroup
from ckpt_plugin.engine.wrap import CheckpointedForward, checkpointing_disabled
from ckpt_plugin.planning.profile import profile

PKG = Path(__file__).resolve().parents[1] / "ckpt_plugin"
OWNER = PKG / "engine" / "forwards.py"
BLOCKS = [f"blocks.{i}" for i in range(4)]

# ---------------------------------------------------------------------- A. who writes forward

_DICT_WRITERS = {"pop", "setdefault", "update", "__setitem__", "__delitem__"}


def _is_instance_dict(node: ast.AST) -> bool:
    """``x.__dict__`` or ``vars(x)``."""
    return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars")


def _names_forward(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "forward"


def _writes_target(target: ast.AST) -> bool:
    """An assignment or ``del`` target that is an object's ``forward``."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_writes_target(t) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _writes_target(target.value)
    if isinstance(target, ast.Attribute):
        return target.attr == "forward"
    return isinstance(target, ast.Subscript) and _is_instance_dict(target.value) and _names_forward(target.slice)


def _writes_call(call: ast.Call) -> bool:
    """``setattr(x, "forward", f)``, ``delattr``, ``object.__setattr__(x, "forward", f)``, ``x.__dict__.pop("forward")``,
    ``x.__dict__.update(forward=f)``, ``x.__dict__.update({"forward": f})`` and the like."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name in {"setattr", "delattr", "__setattr__", "__delattr__"}:
        return any(_names_forward(a) for a in call.args)
    if name in _DICT_WRITERS and isinstance(func, ast.Attribute) and _is_instance_dict(func.value):
        return (any(_names_forward(a) for a in call.args)
                or any(k.arg == "forward" for k in call.keywords)
                or any(isinstance(a, ast.Dict) and any(_names_forward(k) for k in a.keys) for a in call.args))
    return False


def forward_writes(source: str) -> list[int]:
    """The lines of ``source`` that assign or delete an object's ``forward``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call):
            if _writes_call(node):
                lines.append(node.lineno)
            continue
        else:
            continue
        if any(_writes_target(t) for t in targets):
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("source", [
    'm.__dict__["forward"] = f',
    'modules[name].__dict__["forward"] = f',
    'del m.__dict__["forward"]',
    'm.__dict__.pop("forward", None)',
    'm.__dict__.setdefault("forward", f)',
    'm.__dict__.update(forward=f)',
    'm.__dict__.update({"forward": f})',
    'm.__dict__.__setitem__("forward", f)',
    'vars(m)["forward"] = f',
    'm.forward = f',
    'self.layer.forward = f',
    'a, m.forward = 1, f',
    'm.forward: Callable = f',
    'del m.forward',
    'setattr(m, "forward", f)',
    'delattr(m, "forward")',
    'object.__setattr__(m, "forward", f)',
    'nn.Module.__setattr__(m, "forward", f)',
    'def install(m, f):\n    if m is not None:\n        m.__dict__["forward"] = f',
])
def test_the_scan_sees_every_way_to_write_forward(source: str) -> None:
    assert forward_writes(source), source


@pytest.mark.parametrize("source", [
    'f = m.__dict__.get("forward")',
    'wrapped = "forward" in m.__dict__',
    'y = m.forward(x)',
    'inner = m.forward',
    'self.forward_flops[name] += 1',
    'm.__dict__["_ckpt_plugin_op_groups"] = found',
    'rows["forward"] = 1',  # a plain dict's key, no module's attribute
    'setattr(m, "weight", w)',
])
def test_the_scan_leaves_reads_and_other_names_alone(source: str) -> None:
    assert forward_writes(source) == []


def test_only_engine_forwards_writes_a_modules_forward() -> None:
    found = {
        f"{path.relative_to(PKG.parent)}:{line}"
        for path in sorted(PKG.rglob("*.py")) if path != OWNER
        for line in forward_writes(path.read_text())
    }
    assert not found, f"write forward through ckpt_plugin.engine.forwards (set_forward, TemporaryForwards): {sorted(found)}"


def test_engine_forwards_is_where_forward_is_written() -> None:
    """The scan finds what it looks for where it must be: the one owner writes and deletes it."""
    assert len(forward_writes(OWNER.read_text())) >= 2


# ---------------------------------------------------------------------- B. what TemporaryForwards restores

def _counted(inner, calls: list):
    def run(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    return run


def test_a_normal_exit_gives_the_class_forward_back() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(4, 3), torch.randn(2, 4)
    expected, calls = layer(x), []
    with TemporaryForwards([(layer, _counted(layer.forward, calls))]):
        assert torch.equal(layer(x), expected) and calls == [1]
    assert "forward" not in layer.__dict__
    assert torch.equal(layer(x), expected) and calls == [1]


def test_an_exception_in_the_block_gives_back_the_very_forward_it_had() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(4, 3), torch.randn(2, 4)
    own = _counted(layer.forward, [])
    set_forward(layer, own)
    with pytest.raises(RuntimeError, match="in the block"):
        with TemporaryForwards() as forwards:
            forwards.replace(layer, lambda x: x)
            raise RuntimeError("in the block")
    assert instance_forward(layer) is own
    set_forward(layer, None)
    assert "forward" not in layer.__dict__


def test_an_exception_while_replacing_restores_those_already_replaced() -> None:
    layer = nn.Linear(4, 3)
    with pytest.raises(AttributeError, match="__dict__"):
        with TemporaryForwards([(layer, lambda x: x), (object(), lambda x: x)]):
            pytest.fail("the block must not run")
    assert "forward" not in layer.__dict__


def test_replaced_twice_and_nested_each_block_restores_what_it_found() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(4, 3), torch.randn(2, 4)
    expected, first, second, inner = layer(x), [], [], []
    with TemporaryForwards() as outer:
        outer.replace(layer, _counted(layer.forward, first))
        outer.replace(layer, _counted(layer.forward, second))  # wraps the first
        set_by_outer = instance_forward(layer)
        with TemporaryForwards([(layer, _counted(layer.forward, inner))]):
            assert torch.equal(layer(x), expected)
        assert instance_forward(layer) is set_by_outer
        assert (first, second, inner) == ([1], [1], [1])
    assert "forward" not in layer.__dict__


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(3)  # the same dropout masks in every run
    loss = model.loss(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_around_an_installed_checkpoint_it_composes_and_gives_the_wrapper_back() -> None:
    """A forward replaced over ``install``'s wrapper runs it (one call in forward; the recomputation runs
    the layer's own forward inside it), the step is bitwise the same, and the wrapper comes back."""
    model = small_gpt()
    batch = gpt_batch(model)
    assert apply_checkpointing(model, layers="TransformerBlock") == BLOCKS
    wrappers = [instance_forward(model.get_submodule(n)) for n in BLOCKS]
    assert all(isinstance(w, CheckpointedForward) for w in wrappers)
    expected_loss, expected_grads = _loss_and_grads(model, batch)
    calls: dict[str, list] = {n: [] for n in BLOCKS}
    blocks = [model.get_submodule(n) for n in BLOCKS]
    with TemporaryForwards([(b, _counted(b.forward, calls[n])) for n, b in zip(BLOCKS, blocks, strict=True)]):
        loss, grads = _loss_and_grads(model, batch)
    assert all(c == [1] for c in calls.values())
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(grads[n], expected_grads[n]) for n in expected_grads)
    assert all(instance_forward(b) is w for b, w in zip(blocks, wrappers, strict=True))
    assert wrapped_modules(model) == BLOCKS
    assert remove_checkpointing(model) == BLOCKS
    assert all("forward" not in b.__dict__ for b in blocks)


def test_checkpointing_disabled_gives_back_the_same_wrappers_after_an_exception() -> None:
    model = small_gpt()
    apply_checkpointing(model, layers="TransformerBlock")
    wrappers = [instance_forward(model.get_submodule(n)) for n in BLOCKS]
    with pytest.raises(ValueError, match="measuring failed"):
        with checkpointing_disabled(model):
            assert wrapped_modules(model) == [] and all("forward" not in model.get_submodule(n).__dict__
                                                        for n in BLOCKS)
            raise ValueError("measuring failed")
    assert all(instance_forward(model.get_submodule(n)) is w for n, w in zip(BLOCKS, wrappers, strict=True))


def test_profiling_a_wrapped_model_leaves_every_forward_as_it_was() -> None:
    """``ckpt=auto``'s profile installs a recorded forward on each layer for each step: afterwards every
    module has the very forward it had (the wrappers), and the model computes what it computed."""
    model = small_gpt()
    batch = gpt_batch(model)
    apply_checkpointing(model, layers="TransformerBlock")
    before = {n: instance_forward(m) for n, m in model.named_modules()}
    expected_loss, expected_grads = _loss_and_grads(model, batch)
    profile(model, BLOCKS, lambda: model.loss(batch), depth=1)
    after = {n: instance_forward(m) for n, m in model.named_modules()}
    assert after.keys() == before.keys() and all(after[n] is f for n, f in before.items())
    loss, grads = _loss_and_grads(model, batch)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(grads[n], expected_grads[n]) for n in expected_grads)


def test_ungroup_gives_back_a_forward_set_before_regroup() -> None:
    block = small_resnet(depths=(1,)).stages[0][0]
    own = _counted(block.forward, [])
    set_forward(block, own)
    assert regroup(block) and instance_forward(block) is not own
    ungroup(block)
    assert instance_forward(block) is own

"""``ckpt_plugin._compat``: one test per shim over a private torch API, on CPU with real
tensors and modules, and a test that no other file of the package or its tools reaches a
private torch API except through ``_compat``."""

from __future__ import annotations

import ast
import contextlib
import inspect
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.fx.experimental.proxy_tensor import make_fx
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.checkpoint import checkpoint, noop_context_fn, set_checkpoint_debug_enabled
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin import _compat
from ckpt_plugin._compat import checkpoint as compat_checkpoint
from ckpt_plugin._compat import region_generator

ROOT = Path(__file__).resolve().parents[1]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_every_shim_is_reached_from_the_package() -> None:
    """``_compat`` is a package of one module per concern; callers import every name from the package itself."""
    modules = sorted(ROOT.joinpath("ckpt_plugin", "_compat").glob("[!_]*.py"))
    assert len(modules) > 5
    for path in modules:
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
                    and n.module.startswith("torch") for a in n.names}
        public = {name for name in defined | imported if not name.startswith("_")}
        assert public <= set(_compat.__all__), f"{path.name}: {sorted(public - set(_compat.__all__))} not re-exported"
    assert all(hasattr(_compat, name) for name in _compat.__all__)


# -- re-exported names from private modules --


def test_storage_weak_ref_keys_a_storage_shared_by_views() -> None:
    t = torch.randn(4, 4)
    assert _compat.StorageWeakRef(t.untyped_storage()) == _compat.StorageWeakRef(t[1:].untyped_storage())
    assert _compat.StorageWeakRef(t.untyped_storage()) != _compat.StorageWeakRef(t.clone().untyped_storage())


def test_tree_leaves_of_a_nested_dict() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    leaves = _compat.tree_leaves({"x": a, "y": [b, {"z": c}], "n": None})
    assert len([t for t in leaves if isinstance(t, torch.Tensor)]) == 3
    assert {id(t) for t in leaves if isinstance(t, torch.Tensor)} == {id(a), id(b), id(c)}


def test_tree_flatten_with_path_and_keystr_name_each_leaf() -> None:
    pairs, _ = _compat.tree_flatten_with_path({"x": 1, "y": [2, 3]})
    assert {_compat.keystr(path): leaf for path, leaf in pairs} == {"['x']": 1, "['y'][0]": 2, "['y'][1]": 3}


def test_torch_dispatch_mode_sees_aten_ops() -> None:
    seen = []

    class Recorder(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recorder():
        torch.randn(2, 2).mm(torch.randn(2, 2))
    assert torch.ops.aten.mm.default in seen


def test_register_module_forward_hooks_see_every_module() -> None:
    model, entered, exited = _mlp(), [], []
    pre = _compat.register_module_forward_pre_hook(lambda m, args: entered.append(m))
    post = _compat.register_module_forward_hook(lambda m, args, out: exited.append(m))
    try:
        model(torch.randn(2, 8))
    finally:
        pre.remove()
        post.remove()
    assert entered == [model, *model] and set(map(id, exited)) == set(map(id, entered))
    model(torch.randn(2, 8))  # removed: nothing more
    assert len(entered) == 4


def test_mem_tracker_is_torch_memory_tracker() -> None:
    assert issubclass(_compat.CategoryPeakTracker, _compat.MemTracker)
    assert _compat.MemTracker.__module__.startswith("torch.distributed")


# -- functions and classes of _compat --


def test_storage_key_equal_for_a_view_and_its_base_different_for_a_clone() -> None:
    t = torch.randn(4, 4)
    assert _compat.storage_key(t) == _compat.storage_key(t.t()) == _compat.storage_key(t[2:])
    assert _compat.storage_key(t) != _compat.storage_key(t.clone())
    assert _compat.storage_key(t)[0] == "cpu"


def test_category_peak_tracker_reports_category_peaks_of_a_step() -> None:
    model = _mlp()
    x = torch.randn(32, 8)
    tracker = _compat.CategoryPeakTracker()
    tracker.track_external(model)
    with tracker:
        model(x).square().sum().backward()
    peaks = tracker.category_peaks
    assert peaks["act"] > 0 and peaks["param"] > 0 and peaks["grad"] > 0
    assert peaks["param"] == sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_open_and_close_region_match_the_plain_function() -> None:
    model = _mlp()
    x = torch.randn(4, 8, requires_grad=True)

    def fn(inp: torch.Tensor) -> torch.Tensor:
        return model(inp).sin()

    expected = torch.autograd.grad(fn(x).sum(), [x, *model.parameters()])
    fn_calls = []

    def counted(inp: torch.Tensor) -> torch.Tensor:
        fn_calls.append(1)
        return fn(inp)

    saved, placeholders = [], []

    def pack(t: torch.Tensor) -> torch.Tensor:
        (placeholders if _compat.checkpoint_placeholder(t) else saved).append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gen = _compat.open_region(counted, True, noop_context_fn, x)
        try:
            out = fn(x)  # the region's forward: run by the caller, inside the region
        except BaseException:
            gen.close()
            raise
        _compat.close_region(gen)
    # Only the region's input is saved through the outer hooks: its activations are recomputed
    # (torch 2.11 also saves its 0-element placeholder, see test_checkpoint_placeholder_is_2_11s_only).
    assert len(saved) == 1 and saved[0] is x
    assert [p.numel() for p in placeholders] == ([0] if _SAVES_PLACEHOLDER else [])
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    assert fn_calls == [1]  # recomputed once in backward
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_close_region_refuses_a_generator_that_yields_again() -> None:
    def twice():
        yield
        yield

    gen = twice()
    next(gen)
    with pytest.raises(AssertionError):
        _compat.close_region(gen)


@pytest.mark.parametrize("runner", ["this torch's", "ours"])
def test_a_checkpoint_whose_fn_raised_leaves_nothing_in_force_while_its_error_lives(
        runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 and 2.12 left the region's saved-tensor hooks and forward context in force until the error was
    collected: on Python 3.12, in a reference cycle, anywhere later (``_compat/checkpoint.py``'s ``_CLOSES_ON_ERROR``).
    ``pytest.raises`` holds the error, as that cycle did, on any Python; "ours" runs the region as 2.13 does on
    every torch."""
    if runner == "ours":
        monkeypatch.setattr(compat_checkpoint, "_CLOSES_ON_ERROR", False)
    exits = []

    class Forward(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

        def __exit__(self, *exc):
            exits.append(exc[0])
            return super().__exit__(*exc)

    def fn(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise ValueError("the forward failed")

    depths = (_compat.mode_stack_depth(), _compat.saved_tensors_hooks_depth())
    with pytest.raises(ValueError, match="the forward failed") as raised:
        _compat.non_reentrant_checkpoint(fn, torch.randn(4, requires_grad=True),
                                         context_fn=lambda: (Forward(), contextlib.nullcontext()))
    assert raised.value.__traceback__ is not None  # the frames, and the region's generator, still held
    assert exits == [ValueError]  # exited at once, seeing the error
    assert (_compat.mode_stack_depth(), _compat.saved_tensors_hooks_depth()) == depths


def test_our_run_of_a_region_gives_torchs_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The region as ``non_reentrant_checkpoint`` runs it on torch 2.11 and 2.12, on this torch: bitwise torch's."""
    model, x = _mlp(), torch.randn(4, 8, requires_grad=True)
    calls = []

    def fn(inp: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return model(inp).sin()

    expected = torch.autograd.grad(checkpoint(fn, x, use_reentrant=False).sum(), [x, *model.parameters()])
    monkeypatch.setattr(compat_checkpoint, "_CLOSES_ON_ERROR", False)
    calls.clear()
    got = torch.autograd.grad(_compat.non_reentrant_checkpoint(fn, x).sum(), [x, *model.parameters()])
    assert calls == [1, 1]  # the forward, and one recomputation in backward
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_region_generator_signature_is_checked() -> None:
    generator = region_generator._region_generator()
    assert generator is torch.utils.checkpoint._checkpoint_without_reentrant_generator
    names = list(inspect.signature(generator).parameters)
    assert tuple(names[: len(region_generator._REGION_PARAMETERS)]) == region_generator._REGION_PARAMETERS


def test_region_generator_fails_loudly_on_a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    def reordered(fn, context_fn=None, preserve_rng_state=True, determinism_check="default",
                  debug=False, early_stop=True, *args, **kwargs):
        yield

    monkeypatch.setattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", reordered)
    region_generator._region_generator.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="changed its signature"):
            region_generator._region_generator()
    finally:
        region_generator._region_generator.cache_clear()


def test_checkpoint_wrapper_type_is_what_checkpoint_wrapper_makes() -> None:
    wrapped = checkpoint_wrapper(nn.Linear(2, 2))
    assert type(wrapped) is _compat.checkpoint_wrapper_type()


def test_user_module_unwraps_torch_compile() -> None:
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)  # creating the wrapper compiles nothing
    assert compiled is not model
    assert _compat.user_module(compiled) is model
    assert _compat.user_module(model) is model


def test_tracing_for_compile_false_in_eager_true_under_proxy_tracing() -> None:
    assert _compat.tracing_for_compile() is False
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(_compat.tracing_for_compile())
        return x * 2

    make_fx(f)(torch.randn(2))
    assert seen == [True]
    assert _compat.tracing_for_compile() is False


def test_checkpoint_debug_enabled_follows_torch_setting() -> None:
    assert _compat.checkpoint_debug_enabled() is False
    with set_checkpoint_debug_enabled(True):
        assert _compat.checkpoint_debug_enabled() is True
        with set_checkpoint_debug_enabled(False):
            assert _compat.checkpoint_debug_enabled() is False
    assert _compat.checkpoint_debug_enabled() is False


def test_outer_saved_tensors_hooks_inside_and_outside() -> None:
    def pack(t):
        return t

    def unpack(t):
        return t

    assert _compat.outer_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _compat.outer_saved_tensors_hooks() == (pack, unpack)
    assert _compat.outer_saved_tensors_hooks() is None


def test_version_increments_after_an_in_place_op() -> None:
    t = torch.zeros(3)
    before = _compat.version(t)
    t.add_(1)
    assert _compat.version(t) == before + 1
    view = t[1:]
    view.mul_(2)  # views share the counter
    assert _compat.version(t) == _compat.version(view) == before + 2
    t.clone().add_(1)
    assert _compat.version(t) == before + 2


def test_base_of_a_view_is_its_base() -> None:
    w = nn.Parameter(torch.randn(3, 3))
    assert _compat.base_of(w.t()) is w
    assert _compat.base_of(w) is None
    assert _compat.base_of(w.detach().clone()) is None


def test_is_mutable_on_aten_ops() -> None:
    aten = torch.ops.aten
    assert _compat.is_mutable(aten.add_.Tensor)
    assert _compat.is_mutable(aten.add.out)
    assert not _compat.is_mutable(aten.add.Tensor)
    assert not _compat.is_mutable(aten.mm.default)


def test_argument_of_one_call_passed_defaulted_or_missing() -> None:
    aten = torch.ops.aten
    a, b = torch.ones(2), torch.ones(2)
    assert _compat.argument(aten.add.Tensor, (a, b), {}, "other") is b
    assert _compat.argument(aten.add.Tensor, (a, b), {"alpha": 3}, "alpha") == 3
    assert _compat.argument(aten.add.Tensor, (a, b), {}, "alpha") == 1  # the schema default
    assert _compat.argument(aten.add.Tensor, (a, b), {}, "nope", missing="m") == "m"


def test_checkpointed_fn_names_the_region_saving_its_inputs() -> None:
    found = []

    def pack(t):
        if not _compat.checkpoint_placeholder(t):  # torch 2.11's, saved by the generator too (test below)
            found.append(_compat.checkpointed_fn(inspect.currentframe()))
        return t

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)  # no checkpoint on the stack
        assert found == [None]
        checkpoint(fn, x, use_reentrant=False)
    assert found[1:] == [fn]  # only the region's input, saved by its generator
    assert _compat.checkpointed_fn(None) is None


# torch 2.11 saves a region's inputs through ``_NoopSaveInputs`` with a placeholder first; 2.13 and 2.15 do not.
_SAVES_PLACEHOLDER = torch.__version__.startswith("2.11.")


@pytest.mark.parametrize("fake", [False, True])
def test_checkpoint_placeholder_is_2_11s_only(fake) -> None:
    """What a non-reentrant region packs through the hooks around it: on torch 2.11 a 0-element tensor
    that requires grad, then its inputs; on 2.13 and 2.15 its inputs. Only the first is a placeholder,
    also on fake tensors (``saved_activations``); an empty input of the region is none."""
    x, empty = torch.randn(3, requires_grad=True), torch.empty((0,), requires_grad=True)
    packed = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append((tuple(t.shape), t is x or t is empty, _compat.checkpoint_placeholder(t)))
        return t

    with _compat.fake_tensor_mode() if fake else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            checkpoint(lambda a, b: a.sin() + b.sum(), x, empty, use_reentrant=False)
            assert not _compat.checkpoint_placeholder(torch.empty((0,), requires_grad=True))  # outside a region
    inputs = [((3,), True, False), ((0,), True, False)]  # inside the region, checkpoint's own hooks save
    assert packed == ([((0,), False, True)] if _SAVES_PLACEHOLDER else []) + inputs


def test_hook_count_on_a_module_an_optimizer_and_a_tensor() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _compat.hook_count(model) == _compat.hook_count(opt) == _compat.hook_count(model.weight) == 0
    handles = [
        model.register_forward_hook(lambda *a: None, with_kwargs=True),  # its flag dict is not counted
        model.register_forward_pre_hook(lambda *a: None),
        model.register_full_backward_hook(lambda *a: None),
        opt.register_step_pre_hook(lambda *a: None),
        model.weight.register_hook(lambda g: g),
        model.weight.register_post_accumulate_grad_hook(lambda p: None),
    ]
    assert _compat.hook_count(model) == 3
    assert _compat.hook_count(opt) == 1
    assert _compat.hook_count(model.weight) == 2
    assert _compat.hook_count(model.bias) == 0
    for h in handles:
        h.remove()
    assert _compat.hook_count(model) == _compat.hook_count(opt) == _compat.hook_count(model.weight) == 0


def test_global_hook_count_sees_module_and_optimizer_registries() -> None:
    before = _compat.global_hook_count()
    handles = [
        _compat.register_module_forward_hook(lambda *a: None, always_call=True),
        _compat.register_module_forward_pre_hook(lambda *a: None),
        nn.modules.module.register_module_full_backward_hook(lambda *a: None),
        register_optimizer_step_post_hook(lambda *a: None),
    ]
    try:
        assert _compat.global_hook_count() == before + 4
    finally:
        for h in handles:
            h.remove()
    assert _compat.global_hook_count() == before


def test_saved_tensors_hooks_depth_counts_and_keeps_the_stack() -> None:
    def pack(t):
        return t

    def unpack(t):
        return t

    base = _compat.saved_tensors_hooks_depth()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            assert _compat.saved_tensors_hooks_depth() == base + 2
            assert _compat.outer_saved_tensors_hooks() == (pack, unpack)  # pushed back in order
            assert _compat.saved_tensors_hooks_depth() == base + 2
        assert _compat.saved_tensors_hooks_depth() == base + 1
    assert _compat.saved_tensors_hooks_depth() == base


def test_mode_stack_depth_counts_dispatch_and_function_modes() -> None:
    base = _compat.mode_stack_depth()
    with _compat.TorchDispatchMode():
        assert _compat.mode_stack_depth() == base + 1
        with torch.overrides.TorchFunctionMode():
            assert _compat.mode_stack_depth() == base + 2
    assert _compat.mode_stack_depth() == base


# -- nothing else reaches a private torch API --

# Modules without a leading underscore that are torch internals all the same.
_INTERNAL_MODULES = {"torch.nn.modules.module", "torch.optim.optimizer", "torch.multiprocessing.reductions"}


def _private_attributes() -> frozenset[str]:
    """Private (single-underscore) attributes of torch's tensors, parameters, modules, optimizers and ops."""
    param = nn.Parameter(torch.zeros(1))
    objects = [torch.zeros(1), param, nn.Linear(1, 1), torch.optim.SGD([param], lr=0.1),
               torch.ops.aten.add, torch.ops.aten.add.Tensor]
    return frozenset(n for o in objects for n in dir(o) if n.startswith("_") and not n.startswith("__"))


def _aten_op_names() -> frozenset[str]:
    # Aten op names such as "_addmm_activation" are also private Tensor methods; as strings
    # they are op names (policies.py lists them), not attribute lookups.
    return frozenset(n for n in _private_attributes() if isinstance(getattr(torch.ops.aten, n, None), torch._ops.OpOverloadPacket))


def _is_private_path(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "torch":
        return False
    return dotted in _INTERNAL_MODULES or any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def private_torch_uses(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for each private torch API ``source`` reaches directly."""
    tree = ast.parse(source, filename)
    private_attrs = _private_attributes()
    private_strings = private_attrs - _aten_op_names()
    aliases: dict[str, str] = {}  # local name -> the torch path it stands for
    found: list[tuple[int, str]] = []

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if _is_private_path(alias.name):
                        found.append((node.lineno, f"import {alias.name}"))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            if _is_private_path(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                if alias.name.startswith("_") and not _is_private_path(node.module):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                aliases[alias.asname or alias.name] = path

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                dotted = ".".join([aliases[inner.id], *reversed(chain)])
                prefix = ".".join([aliases[inner.id], *reversed(chain[1:])])
                if _is_private_path(dotted) and not _is_private_path(prefix):  # once per chain, at its first private part
                    found.append((node.lineno, dotted))
                    continue
            if node.attr in private_attrs and not _is_private_path(ast.unparse(node.value)):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value in private_strings or value.startswith("_global_") or (
                    value.startswith("torch.") and value.replace(".", "").replace("_", "").isalnum() and _is_private_path(value)):
                found.append((node.lineno, repr(value)))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def _checked_files() -> list[Path]:
    files = sorted((*ROOT.joinpath("ckpt_plugin").rglob("*.py"), *ROOT.joinpath("ckpt_tools").rglob("*.py")))
    return [f for f in files if ROOT / "ckpt_plugin" / "_compat" not in f.parents]


def test_no_private_torch_api_outside_compat() -> None:
    files = _checked_files()
    assert len(files) > 10 and any(f.name == "soak.py" for f in files)
    problems = [p for f in files for p in private_torch_uses(f.read_text(), str(f.relative_to(ROOT)))]
    assert not problems, "private torch APIs outside ckpt_plugin/_compat/:\n" + "\n".join(problems)


@pytest.mark.parametrize("snippet", [
    "import torch\nautograd = torch._C._autograd",
    "import torch\nn = torch._C._len_torch_dispatch_stack()",
    "import torch.utils.checkpoint\nx = torch.utils.checkpoint._checkpoint_debug_enabled",
    "from torch.utils.checkpoint import _checkpoint_without_reentrant_generator",
    "from torch.utils._pytree import tree_leaves",
    "import torch.utils._python_dispatch as pd",
    "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper",
    "from torch import _dynamo",
    "from torch.nn.modules.module import register_module_forward_hook",
    "from torch.multiprocessing.reductions import StorageWeakRef",
    "from torch import nn\nhooks = nn.modules.module._global_forward_hooks",
    "import importlib\nm = importlib.import_module('torch.nn.modules.module')",
    "import sys\nm = sys.modules.get('torch._dynamo.eval_frame')",
    "def f(t):\n    return t._version",
    "def f(t):\n    return t._base",
    "def f(op):\n    return op._schema.is_mutable",
    "def f(m):\n    return m._forward_hooks",
    "def f(p):\n    return getattr(p, '_backward_hooks', None)",
    "def f(ns):\n    return [k for k in ns if k.startswith('_global_')]",
])
def test_the_check_finds_private_uses(snippet: str) -> None:
    assert private_torch_uses(snippet)


@pytest.mark.parametrize("snippet", [
    "import torch\nx = torch.utils.checkpoint.checkpoint",
    "import torch\nv = torch.__version__",
    "from torch.utils.checkpoint import checkpoint, noop_context_fn",
    "from ckpt_plugin._compat import version\nclass A:\n    def f(self):\n        return self._token",
    "OPS = ('mm', '_addmm_activation', '_scaled_mm')",
    "import torch\nfrom torch import nn\ndef f(m):\n    return torch.ops.aten.mm.default, nn.Linear(2, 2)",
    "x = '_target_'",
])
def test_the_check_passes_public_uses(snippet: str) -> None:
    assert private_torch_uses(snippet) == []


def test_the_check_finds_what_soak_used_before() -> None:
    old = (
        "import importlib\nimport torch\n"
        "def count(p):\n"
        "    n = sum(len(getattr(p, a, None) or ()) for a in ('_backward_hooks', '_post_accumulate_grad_hooks'))\n"
        "    for table in ('torch.nn.modules.module', 'torch.optim.optimizer'):\n"
        "        n += len(vars(importlib.import_module(table)))\n"
        "    return n + torch._C._len_torch_dispatch_stack() + torch._C._len_torch_function_stack()\n"
    )
    problems = private_torch_uses(old, "soak.py")
    assert "soak.py:7: torch._C" in problems
    assert any(":4: '_backward_hooks'" in p for p in problems)
    assert any(":5: 'torch.nn.modules.module'" in p for p in problems)


def test_tree_map_replaces_each_leaf_and_keeps_the_structure() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    mapped = _compat.tree_map(lambda x: x + 1 if isinstance(x, torch.Tensor) else x, ((a, "s"), {"k": [b, None]}))
    assert mapped[0][1] == "s" and mapped[1]["k"][1] is None
    assert torch.equal(mapped[0][0], a + 1) and torch.equal(mapped[1]["k"][0], b + 1)


# -- torch's own memory-budget checkpointing under compile (ckpt_tools/compiled.py) --


def test_activation_memory_budget_sets_the_partitioners_config_and_restores_it() -> None:
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    with _compat.activation_memory_budget(0.25):
        assert functorch_config.activation_memory_budget == 0.25
    assert functorch_config.activation_memory_budget == before == 1.0


def test_compiler_backend_is_what_torch_compile_runs_by_that_name() -> None:
    calls = []
    inner = _compat.compiler_backend("aot_eager")

    def backend(gm, example_inputs):
        calls.append(gm)
        return inner(gm, example_inputs)

    fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend=backend, fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    fn(x).backward()
    assert len(calls) == 1
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_fake_tensor_mode_counts_real_sizes_and_takes_real_tensors():
    real = torch.randn(3, 4)
    with _compat.fake_tensor_mode():
        out = real @ torch.ones(4, 5)
    assert _compat.is_fake(out) and not _compat.is_fake(real) and not _compat.is_fake("tensor")
    assert out.shape == (3, 5) and out.untyped_storage().nbytes() == 3 * 5 * 4
    a, b = out.split(2)
    assert _compat.storage_key(a) == _compat.storage_key(b) != _compat.storage_key(real)


def test_raised_by_fake_tensors_tells_a_data_dependent_op_from_other_errors():
    with pytest.raises(Exception) as info:
        with _compat.fake_tensor_mode():
            torch.ones(2).sum().item()
    assert _compat.raised_by_fake_tensors(info.value)
    assert not _compat.raised_by_fake_tensors(ValueError("shape mismatch"))


# -- user_module: the user's module inside compile, DataParallel, DDP, FSDP and Fabric wrappers --
# (real Fabric, DDP and FSDP, with names and gradients: tests/test_fabric.py)


class _FabricModule(nn.Module):
    """Lightning Fabric's wrapper as user_module sees it: a class of that name holding ``_original_module``."""

    def __init__(self, forward_module: nn.Module, original_module: nn.Module) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module


def test_user_module_looks_through_every_wrapper_in_any_order() -> None:
    model = _mlp()
    assert _compat.user_module(model) is model
    assert _compat.user_module(nn.DataParallel(model)) is model  # CPU: no device, the module runs as it is
    assert _compat.user_module(torch.compile(nn.DataParallel(model))) is model
    assert _compat.user_module(_FabricModule(nn.DataParallel(model), model)) is model
    assert _compat.user_module(torch.compile(_FabricModule(torch.compile(model), model))) is model
    assert _compat.uncompiled(torch.compile(_FabricModule(model, model))) is model  # the former name, same answer


def test_user_module_leaves_lookalikes_alone() -> None:
    class Wrapper(nn.Module):  # holds _original_module, but is no Fabric wrapper
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._original_module = inner

    wrapper = Wrapper(_mlp())
    assert _compat.user_module(wrapper) is wrapper
    no_original = _FabricModule(_mlp(), _mlp())
    del no_original._original_module
    assert _compat.user_module(no_original) is no_original


def test_compile_failures_are_what_fullgraph_compile_raises() -> None:
    def branchy(x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x

    with pytest.raises(_compat.compile_failures()) as info:
        torch.compile(branchy, backend="eager", fullgraph=True)(torch.ones(2))
    assert not _compat.recompile_limit_hit(info.value)
    double = _compat.compile_with_recompile_limit(lambda x: x * 2, "eager", True, 1)
    double(torch.ones(1))
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), pytest.raises(_compat.compile_failures()) as info:
        double(torch.ones(2))
    assert _compat.recompile_limit_hit(info.value)
    torch._dynamo.reset()


def test_compile_with_recompile_limit_holds_for_that_function_only() -> None:
    """The limit holds for the compiled function whatever the global setting, and is not left in force
    (torch 2.11 has no ``recompile_limit=`` keyword: the shim patches the config around each call)."""
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    def halve(x: torch.Tensor) -> torch.Tensor:
        return x / 2

    with torch._dynamo.config.patch(recompile_limit=8, automatic_dynamic_shapes=False):
        limited = _compat.compile_with_recompile_limit(triple, "eager", True, 2)
        assert torch.equal(limited(torch.ones(1)), torch.full((1,), 3.0))
        limited(torch.ones(2))  # the second graph: within the limit
        with pytest.raises(_compat.compile_failures()) as info:
            limited(torch.ones(3))
        assert _compat.recompile_limit_hit(info.value)
        assert _compat.recompile_limit() == 8
        other = torch.compile(halve, backend="eager", fullgraph=True)  # global limit of 8
        for n in range(1, 5):
            other(torch.ones(n))
        # Raised above the global limit too: the function's own limit is the one that holds.
        with torch._dynamo.config.patch(recompile_limit=1):
            higher = _compat.compile_with_recompile_limit(triple, "eager", True, 3)
            torch._dynamo.reset()
            for n in range(1, 4):
                higher(torch.ones(n))
            with pytest.raises(_compat.compile_failures()):
                higher(torch.ones(4))
    torch._dynamo.reset()


def test_recompile_limit_follows_torch_setting() -> None:
    with torch._dynamo.config.patch(recompile_limit=3):
        assert _compat.recompile_limit() == 3


@pytest.mark.parametrize(("op", "args"), [
    (torch.ops.aten.mm.default, lambda: (torch.randn(5, 7), torch.randn(7, 3))),  # by the registry's formula
    (torch.ops.aten.bmm.default, lambda: (torch.randn(2, 5, 7), torch.randn(2, 7, 3))),
    (torch.ops.aten.convolution.default,
     lambda: (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
    (torch.ops.aten.linear.default, lambda: (torch.randn(5, 7), torch.randn(3, 7), torch.randn(3))),  # decomposed
    (torch.ops.aten.matmul.default, lambda: (torch.randn(2, 5, 7), torch.randn(7, 3))),
    (torch.ops.aten.add.Tensor, lambda: (torch.randn(5), torch.randn(5))),  # no FLOPs counted
])
def test_op_flops_counts_what_flop_counter_mode_counts(op, args) -> None:
    """``op_flops`` (the profile's FLOPs, counted in its memory steps) against FlopCounterMode running the op:
    the registry's formula, or for an op FlopCounterMode decomposes, its decomposition counted on the side."""
    args = args()
    with FlopCounterMode(display=False) as counter:
        out = op(*args)
    assert _compat.op_flops(op, args, {}, out) == counter.get_total_flops()
    assert counter.get_total_flops() > 0 or op is torch.ops.aten.add.Tensor


# -- reads of values (measure/values.py) --


def test_reads_values_tells_the_ops_that_answer_from_values() -> None:
    aten = torch.ops.aten
    assert all(_compat.reads_values(op) for op in (aten._local_scalar_dense.default, aten.nonzero.default,
                                                   aten.is_nonzero.default, aten.masked_select.default))
    assert not any(_compat.reads_values(op) for op in (aten.mm.default, aten.masked_fill.Scalar))


def test_fake_read_error_is_fake_tensors_refusal_to_read() -> None:
    with pytest.raises(Exception) as caught, _compat.fake_tensor_mode():
        torch.ones(3).nonzero()
    assert _compat.fake_read_error(caught.value) and not _compat.fake_read_error(ValueError("x"))


def test_in_backward_is_true_only_while_autograd_runs_a_backward() -> None:
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(_compat.in_backward()))
    y.sum().backward()
    assert seen == [True] and not _compat.in_backward()


def test_module_running_finds_the_module_called_and_the_one_recomputed() -> None:
    import sys

    found = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            frame = sys._getframe(1)
            while frame is not None and _compat.module_running(frame) is None:
                frame = frame.f_back
            found.append(_compat.module_running(frame) if frame is not None else None)
            return x.sin()

    probe = Probe()
    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(probe.forward, x, use_reentrant=False).sum().backward()
    probe(x)
    assert found == [None, probe, probe]  # checkpoint calls fn directly; its recompute_fn, then nn.Module's call


def test_fsdp_shards_a_fake_module_on_a_fake_group_and_the_collectives_come_back_as_they_were() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
    before = {n: getattr(dist, n) for n in names if hasattr(dist, n)}  # torch 2.11 has no *_single
    group = _compat.fake_process_group(1, 4)
    assert (group.rank(), group.size()) == (1, 4)
    mode = _compat.fake_tensor_mode()
    model, _copies = _compat.fake_copy(_mlp(), mode)
    with mode, _compat.fsdp_on_fake_tensors():
        sharded = FullyShardedDataParallel(model, process_group=group, device_id=torch.device("cpu"),
                                           use_orig_params=True)
        sharded(torch.randn(3, 8)).sum().backward()
        flat = sharded._flat_param  # this rank's shard: a quarter of the 212 parameters
        assert _compat.is_fake(flat) and flat.numel() == 53 and flat.grad.numel() == 53
    assert before and {n: getattr(dist, n) for n in before} == before


def test_as_parameter_files_a_tensor_the_step_made_under_the_tracker_s_parameters() -> None:
    """What ZeRO-3's played gathering allocates in a step (apply/zero3_gather.py): MemTracker files it as an
    activation; ``as_parameter`` files its 4,000 B as a parameter instead."""
    from ckpt_plugin._compat import CategoryPeakTracker, as_parameter

    tracker = CategoryPeakTracker()
    with tracker:
        kept = torch.empty(1_000)
        as_parameter(kept)
        torch.zeros(1)  # an op after it: the peak MemTracker keeps is updated after each op
    assert tracker.category_peaks["param"] == 4_000


def test_at_backward_end_runs_once_backward_is_done() -> None:
    from ckpt_plugin._compat import at_backward_end

    seen: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    y.grad_fn.register_prehook(lambda grads: at_backward_end(lambda: seen.append("end")) or None)
    x.register_hook(lambda g: seen.append("grad") or None)
    y.backward()
    assert seen == ["grad", "end"]


def test_mod_tracker_calls_a_user_hook_before_each_module_runs() -> None:
    from ckpt_plugin._compat import ModTracker

    called: list[str] = []
    tracker = ModTracker()
    tracker.register_user_hooks(lambda m, _args: called.append(type(m).__name__))
    with tracker:
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())(torch.ones(1, 2))
    assert called == ["Sequential", "Linear", "ReLU"]


def test_seen_bytes_counts_a_batch_the_step_passed_through_an_op() -> None:
    """A batch made before the tracker started: unseen, until an op reads it as a view (DeepSpeed ZeRO-3's hooks
    detach each module's input)."""
    from ckpt_plugin._compat import CategoryPeakTracker, seen_bytes

    batch, other = torch.ones(10), torch.ones(3)
    tracker = CategoryPeakTracker()
    with tracker:
        view = batch.detach()
        (view * 2).sum()
    assert seen_bytes(tracker, {"x": batch, "y": other}) == 40

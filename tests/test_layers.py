"""The package's layering holds, and importing it costs only what is used.

A. Layer direction, read from the source (AST over every ``.py`` of ``ckpt_plugin/``,
   imports inside functions included): each module imports only its own layer or
   lower ones (base < config < engine < measure < planning < apply < runs < lightning: the config
   is read below everything that uses it, the spine, ``apply``, sits above all it joins; ``runs``,
   a run's lifecycle, uses no other layer and sits below the callback, which may use it);
   the library never imports ``ckpt_tools``, ``ckpt_examples``, ``recipes``; the
   torch-only layers import no Lightning/Hydra/OmegaConf (DeepSpeed only lazily);
   ``config/`` no Lightning; ``runs/`` no Hydra/OmegaConf; the modules the search-path
   plugin loads (``config/hydra.py``) no framework at module level; and the
   intra-package import graph has no cycle.
B. Importing costs what it uses, in fresh interpreters: ``import ckpt_plugin`` loads
   no torch, the schema no torch/OmegaConf, the engine's public names no Lightning,
   Hydra, OmegaConf or DeepSpeed; ``ckpt_plugin.ActivationCheckpointing`` is then the
   Lightning callback.
C. An unrelated Hydra app in the same environment: the search-path plugin loads no
   torch or Lightning at start-up and adds only ``ckpt`` and
   ``callbacks/activation_checkpointing``; the same app can compose and instantiate
   the callback.
D. ``recipes.train`` exposes ``train(cfg, ...)``.

The subprocesses (~5 s each, mostly imports) use ``sys.executable``, so they see the
same environment (editable install, ``hydra_plugins`` namespace) as a user would.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ckpt_plugin"

# Lowest first. A module may import its own layer or a lower one.
LAYERS = ["base", "config", "engine", "measure", "planning", "apply", "runs", "lightning"]
RANK = {name: i for i, name in enumerate(LAYERS)}
BASE_MODULES = {"ckpt_plugin", "ckpt_plugin._compat", "ckpt_plugin.errors", "ckpt_plugin.units"}  # the root __init__ is lazy: imports nothing

OUTSIDE = {"ckpt_tools", "ckpt_examples", "recipes", "hydra_plugins", "tests"}  # never imported by the library
LIGHTNING = {"lightning", "pytorch_lightning", "lightning_fabric"}
FRAMEWORKS = LIGHTNING | {"hydra", "omegaconf"}
# third-party top-level names each layer must not import, anywhere in the module
FORBIDDEN = {
    "base": FRAMEWORKS,
    "engine": FRAMEWORKS,
    "measure": FRAMEWORKS,
    "planning": FRAMEWORKS,
    "apply": FRAMEWORKS,
    "config": LIGHTNING,
    "runs": {"hydra", "omegaconf"},  # preemption, atomic saves, resume, SLURM: Lightning's, never Hydra's
}
# modules that must import no framework (torch included) at module level: the search-path plugin loads them
NO_FRAMEWORK_AT_IMPORT = {"ckpt_plugin.config", "ckpt_plugin.config.schema", "ckpt_plugin.config.deepspeed",
                          "ckpt_plugin.config.hydra", "ckpt_plugin.config.budget", "ckpt_plugin.config.values",
                          "ckpt_plugin.config.keys", "ckpt_plugin.config.memory"}
HEAVY = {"torch", "deepspeed"} | FRAMEWORKS


# --------------------------------------------------------------------------------------
# Reading the imports
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    file: str  # relative to the checkout
    line: int
    target: str  # the module imported, resolved (intra-package: the deepest module that exists)
    function_level: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _lazy_table() -> dict[str, str]:
    """The root ``__init__``'s ``_WHERE`` (public name -> defining module), so ``from ckpt_plugin import X`` resolves."""
    tree = ast.parse(MODULES["ckpt_plugin"].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_WHERE" for t in node.targets):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "_WHERE":
            return ast.literal_eval(node.value)
    raise AssertionError("ckpt_plugin/__init__.py defines no _WHERE table (public name -> module)")


LAZY = _lazy_table()


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    rel = str(path.relative_to(ROOT))
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=rel)
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the TYPE_CHECKING body never runs
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(rel, node.lineno, alias.name, in_function))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, is_package, node)
            for alias in node.names:
                target = source
                if source == "ckpt_plugin" and alias.name in LAZY:
                    target = LAZY[alias.name]  # through the lazy table: what `from ckpt_plugin import X` really loads
                elif f"{source}.{alias.name}" in MODULES:
                    target = f"{source}.{alias.name}"  # `from pkg import submodule`
                found.append(Import(rel, node.lineno, target, in_function))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


IMPORTS: dict[str, list[Import]] = {m: imports_of(m) for m in MODULES}


def layer_of(module: str) -> str | None:
    if module in BASE_MODULES or module.startswith("ckpt_plugin._compat."):  # _compat is a package of shims
        return "base"
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "ckpt_plugin" and parts[1] in RANK and parts[1] != "base":
        return parts[1]
    return None


def intra_target(target: str) -> str | None:
    """The package module ``target`` names (itself, or the nearest enclosing module that exists), or None if outside."""
    if target.split(".")[0] != "ckpt_plugin":
        return None
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


# --------------------------------------------------------------------------------------
# A. Layer direction and cycles (source only)
# --------------------------------------------------------------------------------------


def test_the_scan_sees_the_package() -> None:
    """Guard against a vacuous pass: every layer has modules, and known imports are found."""
    layers = {layer_of(m) for m in MODULES}
    assert set(LAYERS) <= layers, f"layers without modules: {set(LAYERS) - layers}"
    targets = {i.target for i in IMPORTS["ckpt_plugin.lightning.callback"]}
    assert "ckpt_plugin.apply.plan" in targets and "lightning.pytorch" in targets, targets
    lazy = [i for i in IMPORTS["ckpt_plugin.engine.deepspeed"] if i.target == "deepspeed"]
    assert lazy and all(i.function_level for i in lazy), lazy


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of {LAYERS}: {unplaced}"


def test_imports_go_to_the_same_or_a_lower_layer() -> None:
    bad = []
    for module, imports in IMPORTS.items():
        own = layer_of(module)
        for imp in imports:
            target = intra_target(imp.target)
            if target is None or own is None:
                continue
            theirs = layer_of(target)
            if theirs is None or RANK[theirs] > RANK[own]:
                bad.append(f"{imp.file}:{imp.line} imported {imp.target} ({own} -> {theirs})")
    assert not bad, "imports up the layers (" + " < ".join(LAYERS) + "):\n" + "\n".join(bad)


def test_the_library_imports_nothing_outside_it() -> None:
    bad = [
        f"{imp.file}:{imp.line} imported {imp.target}"
        for imports in IMPORTS.values()
        for imp in imports
        if imp.target.split(".")[0] in OUTSIDE
    ]
    assert not bad, f"ckpt_plugin imports {sorted(OUTSIDE)}:\n" + "\n".join(bad)


def test_lower_layers_import_no_framework() -> None:
    bad = []
    for module, imports in IMPORTS.items():
        forbidden = FORBIDDEN.get(layer_of(module) or "", set())
        for imp in imports:
            if imp.target.split(".")[0] in forbidden:
                bad.append(f"{imp.file}:{imp.line} imported {imp.target} ({layer_of(module)} layer)")
    assert not bad, "framework imports below the Lightning layer:\n" + "\n".join(bad)


def test_deepspeed_is_imported_lazily_below_lightning() -> None:
    bad = []
    for module, imports in IMPORTS.items():
        layer = layer_of(module)
        if layer is None or RANK[layer] >= RANK["lightning"]:
            continue
        for imp in imports:
            if imp.target.split(".")[0] == "deepspeed" and (layer != "engine" or not imp.function_level):
                where = "module level" if not imp.function_level else f"{layer} layer"
                bad.append(f"{imp.file}:{imp.line} imported {imp.target} ({where})")
    assert not bad, "DeepSpeed must be imported only inside engine functions:\n" + "\n".join(bad)


def test_schema_modules_import_no_framework_at_module_level() -> None:
    bad = []
    for module in sorted(NO_FRAMEWORK_AT_IMPORT):
        for imp in IMPORTS[module]:
            if not imp.function_level and imp.target.split(".")[0] in HEAVY:
                bad.append(f"{imp.file}:{imp.line} imported {imp.target}")
            target = intra_target(imp.target)
            if not imp.function_level and target and target not in BASE_MODULES and target not in NO_FRAMEWORK_AT_IMPORT:
                bad.append(f"{imp.file}:{imp.line} imported {imp.target} (not known to be framework-free)")
    assert not bad, "modules the search-path plugin loads import frameworks at import time:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, imports in IMPORTS.items():
        for imp in imports:
            target = intra_target(imp.target)
            if target is None or target == module:
                continue
            if MODULES[module].name == "__init__.py" and target.startswith(module + "."):
                continue  # a package __init__ importing its own children
            graph[module].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's SCCs (iterative); only those with more than one module (self-imports are dropped above)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))
    return out


def test_cycle_finder_finds_cycles() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    assert shortest_cycle({"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"b"}}, ["a", "b", "c", "d"]) == ["a", "b", "c", "a"]


def shortest_cycle(graph: dict[str, set[str]], scc: list[str]) -> list[str]:
    """A shortest cycle through ``scc[0]`` inside the SCC, as [a, b, ..., a] (breadth-first)."""
    members, start = set(scc), scc[0]
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                back = [node]
                while back[-1] != start:
                    back.append(parent[back[-1]])
                return [*reversed(back), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {scc}")


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = strongly_connected(graph)
    detail = []
    for scc in cycles:
        path = shortest_cycle(graph, scc)
        detail.append("cycle: " + " -> ".join(path))
        for a, b in zip(path, path[1:]):
            imp = next(i for i in IMPORTS[a] if intra_target(i.target) == b)
            detail.append(f"  {imp.file}:{imp.line} imported {imp.target}")
    assert not cycles, f"import cycles (function-level imports included), by strongly connected component: {cycles}\n" + "\n".join(detail)


# --------------------------------------------------------------------------------------
# B. Importing costs what it uses (fresh interpreters)
# --------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def run_python(code: str, cwd: Path | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one ``RESULT <json>`` line, returned parsed."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=_env(), cwd=cwd or ROOT, timeout=120,
    )  # fmt: skip
    return _result(proc)


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, (
        f"exit {proc.returncode}:\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
    return json.loads(lines[0][len("RESULT ") :])


LOADED = """
def loaded(*names):
    return sorted(n for n in names if n in sys.modules or any(m.startswith(n + ".") for m in sys.modules))
"""


def test_import_ckpt_plugin_loads_no_torch_and_schema_no_framework() -> None:
    r = run_python(
        "import json, sys\n" + LOADED + """
import ckpt_plugin
after_root = loaded("torch", "lightning", "pytorch_lightning", "hydra", "omegaconf", "deepspeed")
import ckpt_plugin.config.schema
after_schema = loaded("torch", "lightning", "pytorch_lightning", "hydra", "omegaconf", "deepspeed")
import ckpt_plugin.config.hydra
after_configs = loaded("torch", "lightning", "pytorch_lightning", "omegaconf", "deepspeed")
print("RESULT " + json.dumps(dict(root=after_root, schema=after_schema, configs=after_configs)))
"""
    )
    assert r["root"] == [], f"`import ckpt_plugin` loaded {r['root']}"
    assert r["schema"] == [], f"`import ckpt_plugin.config.schema` loaded {r['schema']}"
    assert r["configs"] == [], f"`import ckpt_plugin.config.hydra` (what the search-path plugin loads) loaded {r['configs']}"


def test_engine_names_load_torch_only_and_the_callback_is_lightnings() -> None:
    r = run_python(
        "import json, sys\n" + LOADED + """
from ckpt_plugin import apply_checkpointing, checkpoint, offloading, remove_checkpointing
heavy = loaded("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric", "hydra", "omegaconf", "deepspeed")
torch_loaded = "torch" in sys.modules
import ckpt_plugin
cls = ckpt_plugin.ActivationCheckpointing
import lightning.pytorch as pl
print("RESULT " + json.dumps(dict(
    heavy=heavy, torch=torch_loaded, is_callback=isinstance(cls, type) and issubclass(cls, pl.Callback),
    where=f"{cls.__module__}.{cls.__qualname__}",
)))
"""
    )
    assert r["heavy"] == [], f"importing the engine's public names loaded {r['heavy']}"
    assert r["torch"], "importing apply_checkpointing/checkpoint/... did not load torch"
    assert r["is_callback"], f"ckpt_plugin.ActivationCheckpointing ({r['where']}) is not a lightning.pytorch.Callback"
    assert r["where"] == "ckpt_plugin.lightning.callback.ActivationCheckpointing", r["where"]


# --------------------------------------------------------------------------------------
# C. An unrelated Hydra app in the same environment
# --------------------------------------------------------------------------------------

GROUPS = ["model", "data", "trainer", "ckpt", "callbacks", "hydra/launcher"]

BARE_APP = """\
import json
import sys

STARTUP = {"torch": "torch" in sys.modules, "lightning": "lightning" in sys.modules}

import hydra
from hydra.core.global_hydra import GlobalHydra


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    seen = {"torch": "torch" in sys.modules, "lightning": "lightning" in sys.modules}
    loader = GlobalHydra.instance().config_loader()
    groups = {name: sorted(loader.get_group_options(name)) for name in GROUPS}
    print("RESULT " + json.dumps(dict(startup=STARTUP, seen=seen, groups=groups, greeting=cfg.greeting)))


if __name__ == "__main__":
    main()
"""

PLUGIN_APP = """\
import json
import sys

import hydra
from hydra.utils import instantiate


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    startup = {"torch": "torch" in sys.modules, "lightning": "lightning" in sys.modules}
    target = cfg.callbacks.activation_checkpointing._target_
    mode = cfg.ckpt.mode
    callback = instantiate(cfg.callbacks.activation_checkpointing)
    import lightning.pytorch as pl
    from ckpt_plugin import ActivationCheckpointing

    print("RESULT " + json.dumps(dict(
        startup=startup, target=target, mode=mode, layers=cfg.ckpt.layers,
        type=f"{type(callback).__module__}.{type(callback).__qualname__}",
        is_ours=isinstance(callback, ActivationCheckpointing), is_callback=isinstance(callback, pl.Callback),
    )))


if __name__ == "__main__":
    main()
"""


def run_app(tmp_path: Path, source: str, config: str, *overrides: str) -> dict:
    """Write a Hydra app (``app.py``, ``conf/config.yaml``) into ``tmp_path`` and run it there."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(config)
    (tmp_path / "app.py").write_text(source)
    cmd = [sys.executable, str(tmp_path / "app.py"), f"hydra.run.dir={tmp_path / 'out'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    return _result(proc)


def test_unrelated_hydra_app_sees_only_what_the_plugin_adds(tmp_path: Path) -> None:
    r = run_app(tmp_path, BARE_APP.replace("GROUPS", repr(GROUPS)), "greeting: hello\n")
    assert r["greeting"] == "hello"
    assert not r["startup"]["torch"] and not r["startup"]["lightning"], f"loaded before Hydra started: {r['startup']}"
    assert not r["seen"]["torch"], "torch was loaded when Hydra started the app (the search-path plugin must be cheap)"
    assert not r["seen"]["lightning"], "Lightning was loaded when Hydra started the app"
    groups = r["groups"]
    for name in ("model", "data", "trainer"):
        assert groups[name] == [], f"an unrelated app sees group {name!r} options {groups[name]} (the plugin adds none)"
    missing = {"full", "selective", "offload", "auto", "none"} - set(groups["ckpt"])
    assert not missing, f"ckpt presets missing in the app: {sorted(missing)} (has {groups['ckpt']})"
    assert groups["callbacks"] == ["activation_checkpointing"], groups["callbacks"]
    assert "slurm" not in groups["hydra/launcher"], groups["hydra/launcher"]


def test_plugin_configs_ship_only_ckpt_and_the_callback() -> None:
    configs = PKG / "config"
    shipped = sorted(
        str(p.relative_to(configs))
        for p in configs.rglob("*")
        if p.is_file() and p.suffix in (".yaml", ".yml")  # the configs; app.py is the Hydra app's helpers
    )
    extra = [s for s in shipped if not (s.startswith("ckpt/") and s.endswith(".yaml")) and s != "callbacks/activation_checkpointing.yaml"]
    assert not extra, f"ckpt_plugin/config ships more than ckpt/*.yaml and callbacks/activation_checkpointing.yaml: {extra}"
    assert "callbacks/activation_checkpointing.yaml" in shipped, shipped
    assert [p for p in shipped if p.startswith("ckpt/")], "no ckpt presets shipped"


def test_unrelated_hydra_app_can_use_the_plugin(tmp_path: Path) -> None:
    config = "defaults:\n  - callbacks: activation_checkpointing\n  - _self_\n"
    r = run_app(tmp_path, PLUGIN_APP, config, "ckpt.layers=Linear")
    assert not r["startup"]["torch"] and not r["startup"]["lightning"], f"loaded before instantiate: {r['startup']}"
    assert r["target"] == "ckpt_plugin.ActivationCheckpointing", r["target"]
    assert r["mode"] == "full", r["mode"]
    assert r["layers"] == "Linear", r["layers"]
    assert r["is_ours"] and r["is_callback"], f"instantiate built {r['type']}, not an ActivationCheckpointing callback"


# --------------------------------------------------------------------------------------
# D. The recipe's entry point
# --------------------------------------------------------------------------------------


def test_recipe_exposes_train_cfg() -> None:
    from recipes.train import train

    params = list(inspect.signature(train).parameters)
    assert params and params[0] == "cfg", f"recipes.train.train{inspect.signature(train)}: first parameter is not cfg"
    assert callable(train)

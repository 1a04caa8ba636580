"""The one place that touches private or moving torch APIs.

Every private torch name the package and its tools use is reached through
this file (``tests/test_compat.py`` has a test per shim, and a test that no
other file imports a private torch module). If a torch release moves one of
these, this file is the only one to change. Tested on the torch the project
declares (``pyproject.toml``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch.distributed._tools.mem_tracker import MemTracker  # private: torch._tools
from torch.multiprocessing.reductions import StorageWeakRef  # what torch.utils.checkpoint keys storages by
from torch.nn.modules.module import (  # public (documented under this path), kept here with the other internals
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode  # documented, but in a private module
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves  # pytree: private module, stable API


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (private: ``torch._subclasses``) in which real tensors may take part.

    Inside it ops make fake tensors: shapes, dtypes, devices and storage sizes
    are the real ones, nothing is allocated and no kernel runs. Real
    parameters, buffers and inputs are converted on use, so a model and its
    sample batch run as they are.
    """
    return _fake_mode_class()(allow_non_fake_inputs=True)


@functools.cache
def _fake_mode_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _FakeTensorMode(FakeTensorMode):
        """torch's fake mode, and ``_grouped_mm`` in every dtype its CPU kernel takes.

        Hugging Face's MoE layers (Mixtral, Qwen2-MoE, OLMoE in transformers 5) run their
        experts through ``torch._grouped_mm``, whose CPU kernel takes float32, while its meta
        function (torch 2.13, ``_meta_grouped_mm_common``) checks for bfloat16, as the CUDA
        kernel needs: the fake forward of a float32 MoE raised where the real one runs. The
        output's shape does not depend on the dtype: it is taken from the bfloat16 meta and
        given the inputs' dtype.
        """

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                dtype = args[0].dtype
                cast = tuple(a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args))
                return super().__torch_dispatch__(func, types, cast, kwargs).to(dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return _FakeTensorMode


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The FLOPs ``FlopCounterMode`` counts for one op that ran (``out``), without running it again.

    Its registry (``torch.utils.flop_counter.flop_registry``) counts matmuls, convolutions and
    attention by shape. An op it has no formula for, FlopCounterMode runs decomposed
    (``OpOverload.decompose``, CompositeImplicitAutograd) and counts the parts: here the
    decomposition runs on the side, under a FlopCounterMode of its own, only for such ops.
    """
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    count = flop_registry.get(func._overloadpacket)
    if count is not None:
        return count(*args, **kwargs, out_val=out)
    if not _decomposes(func):
        return 0
    with FlopCounterMode(display=False) as counter:
        func.decompose(*args, **kwargs)
    return counter.get_total_flops()


@functools.cache
def _decomposes(func: Any) -> bool:
    """``func`` is an op FlopCounterMode would decompose: a CompositeImplicitAutograd kernel or a Python one."""
    if isinstance(func, torch._ops.HigherOrderOperator) or func is torch.ops.prim.device.default:
        return False
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in getattr(func, "py_kernels", {}) or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


def is_fake(t: Any) -> bool:
    """A fake tensor (made under :func:`fake_tensor_mode`), whose data cannot be read."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(t, torch.Tensor) and _is_fake(t)


def raised_by_fake_tensors(err: BaseException) -> bool:
    """``err`` comes from fake tensors (``torch._subclasses``: a data-dependent op such as
    ``.item()``, an op without a fake kernel, devices that fake propagation cannot reconcile)."""
    return type(err).__module__.startswith("torch._subclasses") or "FakeTensor" in str(err)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage, shared by views (``untyped_storage`` is public)."""
    try:
        st = t.untyped_storage()
        if is_fake(t):  # no data pointer; torch keeps one Python object per live storage
            return (str(t.device), id(st))
        ptr = st.data_ptr()
    except (NotImplementedError, RuntimeError):  # wrapper subclasses (FSDP2's DTensor parameters) have none
        return (str(t.device), id(t))
    return (str(t.device), ptr) if ptr else (str(t.device), id(st))


class _NoHook:
    """A removable handle of a hook never registered."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class CategoryPeakTracker(MemTracker):
    """``MemTracker`` that also records each category's own peak over the step.

    MemTracker's ``get_tracker_snapshot("peak")`` gives the split at the moment
    the *total* peaked; the activation peak is usually earlier (end of forward)
    than the total peak (gradients alive), so we keep the per-category maxima
    from the same live snapshot MemTracker updates after every op.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.category_peaks: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # MemTracker files what backward makes as temporaries, except inside a recomputation
        # that a module's own forward hooks announce (``_in_ac``): the recompute of a module
        # wrapped by an instance-level forward, or of a plain function, would land in TEMP
        # op by op, between the hooks of its submodules. In backward, autograd runs its nodes
        # with grad mode off (unless create_graph), and checkpoint re-enables it for the
        # recomputation: so a grad-enabled op in backward is a recomputed activation.
        if not self._in_ac and torch.is_grad_enabled() and self._mod_tracker.is_bw:
            self._in_ac = True
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_ac = False
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        # MemTracker registers a gradient hook on every parameter of every module it enters, and
        # register_hook raises on one that does not require grad (torch 2.13): a frozen sinusoidal
        # position table (Pegasus, Marian, Whisper), a LoRA's frozen base. Such a parameter never
        # gets a gradient, so it is marked as hooked already, with handles that remove nothing.
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state: Any) -> None:  # private hook of MemTracker
        super()._update_peak_stats(peak_state)
        for dev_snap in self._curr_mem_snap.values():
            for key, value in dev_snap.items():
                name = getattr(key, "name", str(key)).lower()
                if value > self.category_peaks.get(name, 0):
                    self.category_peaks[name] = value


# The parameters of ``_checkpoint_without_reentrant_generator`` before its ``*args`` (torch 2.11 to 2.15:
# ``fn, preserve_rng_state=True, context_fn=noop_context_fn, determinism_check="default",
# debug=False, early_stop=True, *args, **kwargs``, 2.14 and 2.15 with a keyword-only parameter more).
_REGION_PARAMETERS = ("fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


@functools.cache
def _region_generator() -> Any:
    """torch's private region generator, once its signature is checked to be the one we call.

    :func:`open_region` must pass the named parameters positionally (see there); a torch
    that renamed, reordered, added or dropped one would otherwise take our values for the
    wrong parameters without a word, so it fails here instead.
    """
    from torch.utils.checkpoint import _checkpoint_without_reentrant_generator  # private

    params = list(inspect.signature(_checkpoint_without_reentrant_generator).parameters.values())
    named = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # Keyword-only parameters with a default may follow ``*args``: we leave them at it. torch 2.14 and 2.15
    # have ``respect_saved_tensors_hooks=None`` there (whether torch's own selective checkpoint routes what it
    # saves through the caller's saved_tensors_hooks; None: as before), 2.11 to 2.13 have none.
    kinds = [p.kind for p in params if not (p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty)]
    expected_kinds = [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(_REGION_PARAMETERS) + [
        inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    if named != _REGION_PARAMETERS or kinds != expected_kinds:
        raise RuntimeError(
            "torch.utils.checkpoint._checkpoint_without_reentrant_generator changed its signature to "
            f"{inspect.signature(_checkpoint_without_reentrant_generator)}; ckpt_plugin._compat.open_region "
            f"expects ({', '.join(_REGION_PARAMETERS)}, *args, **kwargs) and needs updating for this torch"
        )
    return _checkpoint_without_reentrant_generator


def open_region(fn: Any, preserve_rng_state: bool, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Start a non-reentrant checkpoint region that later code (not one call) runs inside.

    torch's composable ``checkpoint`` opens its region in a forward pre-hook and
    closes it in a forward hook with this private generator; we do the same
    for regions spanning several layers (``engine/chain.py``). ``fn(*args, **kwargs)``
    is what recomputation runs. Close with :func:`close_region` (or ``gen.close()`` on error).
    """
    generator = _region_generator()
    # Positional, not by keyword: the generator's inputs follow as ``*args``, and Python fills
    # named parameters from positional arguments first, so naming them (``fn=fn, ...``) next to
    # any positional input raises "got multiple values". (``args`` cannot go into a closure either:
    # torch saves them as the region's inputs and infers the device and RNG states from them.)
    # ``_region_generator`` checks the names and order instead, so a torch that changes them fails
    # loudly. Same values as torch's composable checkpoint passes.
    gen = generator(
        fn,  # fn
        preserve_rng_state,  # preserve_rng_state
        context_fn,  # context_fn
        "default",  # determinism_check
        False,  # debug
        True,  # early_stop
        *args,
        **kwargs,
    )
    next(gen)
    return gen


def close_region(gen: Any) -> None:
    """End a region :func:`open_region` started (its generator must finish on this step)."""
    try:
        next(gen)
    except StopIteration:
        return
    raise AssertionError("a checkpoint region generator yielded twice")


def checkpoint_wrapper_type() -> type:
    """torch's ``CheckpointWrapper`` (what FSDP's activation_checkpointing_policy inserts)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # private module

    return CheckpointWrapper


# -- the user's own module inside the wrappers a training setup puts around it (selection.py, wrap.py) --

def _inner(model: Any) -> Any:
    """The module one wrapper layer holds, or None when ``model`` is no wrapper we know."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod  # torch.compile: private attribute, no public getter
    # Lightning Fabric's ``fabric.setup(model)``, detected without importing Lightning:
    # ``_FabricModule._original_module`` (private to Lightning) is the module the user passed,
    # while ``_forward_module`` may be the strategy's wrapper (DDP, FSDP) around it.
    original = getattr(model, "_original_module", None) if type(model).__name__ == "_FabricModule" else None
    if isinstance(original, torch.nn.Module):
        return original
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module  # public
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")  # FSDP (v1), if in use
    if fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel):
        return model.module  # public property: the root's ``_fsdp_wrapped_module``
    return None


def user_module(model: Any) -> Any:
    """The module the user built, inside any ``torch.compile``, DDP, DataParallel, FSDP (v1)
    or Lightning Fabric wrapper, nested in any order; ``model`` itself if it is none of those.

    Its names are the user's own (``blocks.0``, not ``_forward_module.module.blocks.0``),
    and its modules are the very ones the wrappers run, so wrapping them is what
    training runs (dynamo guards on each module's ``forward``: a change after a
    compiled run recompiles). Inner FSDP (v1) units keep torch's
    ``_fsdp_wrapped_module`` in their names: they are modules of the model now.
    """
    while (inner := _inner(model)) is not None:
        model = inner
    return model


def compiled_by_user(model: Any, names: list[str]) -> bool:
    """Whether the step runs the layers ``names`` (of ``user_module(model)``) compiled by the user's own
    ``torch.compile``: ``model`` or a wrapper in it is compiled, Lightning compiled the LightningModule
    (``trainer.fit(torch.compile(model))`` keeps the compile in ``_compiler_ctx``, private to
    Lightning), or a layer or one of its parents was compiled in place (``Module.compile()`` sets the
    private ``_compiled_call_impl``) or replaced by a compiled module."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # not imported: nothing was compiled
        return False
    while model is not None:
        if isinstance(model, eval_frame.OptimizedModule) or getattr(model, "_compiler_ctx", None) is not None:
            return True
        root, model = model, _inner(model)
    modules = dict(root.named_modules())
    for name in names:
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            module = modules.get(".".join(parts[:depth]))
            if isinstance(module, eval_frame.OptimizedModule) or getattr(module, "_compiled_call_impl", None):
                return True
    return False


def uncompiled(model: Any) -> Any:
    """Former name of :func:`user_module` (which also looks through DDP, FSDP and Fabric)."""
    return user_module(model)


def tracing_for_compile() -> bool:
    """Whether AOTAutograd is tracing right now (torch.compile, export), as torch's checkpoint
    itself decides it (``torch.utils.checkpoint._is_compiling``: a proxy dispatch mode is
    active); it then accepts only torch's own selective-checkpoint modes from ``context_fn``."""
    non_strict = getattr(torch.compiler, "_is_non_strict_tracing", None)  # new in torch 2.12; 2.11 has none
    if non_strict is not None and non_strict():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def checkpoint_debug_enabled() -> bool:
    """Whether ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` is in force (no getter)."""
    return bool(torch.utils.checkpoint._checkpoint_debug_enabled)


# -- for selective checkpointing's dispatch modes (policies.py) --

def outer_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair of the innermost ``saved_tensors_hooks``, or None (no public getter)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def version(t: torch.Tensor) -> int:
    """The in-place write counter autograd checks saved tensors against (``Tensor._version``,
    private, no public getter; policies.py and offload.py key cached tensors by it)."""
    return t._version


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None (``Tensor._base``: semi-public, undocumented).

    measure/memory.py and engine/offload.py use it to treat a view of a parameter
    (``weight.t()`` saved by a matmul) as the parameter.
    """
    return t._base


def is_mutable(op: Any) -> bool:
    """In-place and ``out=`` overloads write into an argument."""
    return op._schema.is_mutable


@functools.cache
def _written_arguments(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op`` writes into; () for a functional op. Read once per op: a
    selective region asks it of every op it runs."""
    if not op._schema.is_mutable:
        return ()
    return tuple((i, arg.name) for i, arg in enumerate(op._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def written(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors one call of ``op`` writes into (its schema's ``Tensor(a!)`` arguments: ``self`` of an in-place
    op, ``out=``); [] for a functional op."""
    found = []
    for i, name in _written_arguments(op):
        value = args[i] if i < len(args) else kwargs.get(name)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in values if isinstance(t, torch.Tensor)]
    return found


def argument(op: Any, args: tuple, kwargs: dict, name: str, missing: Any = None) -> Any:
    """Argument ``name`` of one call of ``op`` (its schema default if not passed; ``missing`` if none)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name, arg.default_value)
    return missing


# -- for saved_activations' row sources (residuals.py) --

_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
# torch 2.14 and 2.15 run the region in ``_checkpoint_without_reentrant_generator_impl``, which the
# generator of that name delegates to (``fn`` is a local of both); 2.11 to 2.13 run it in the generator itself.
_REGION_FUNCTIONS = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")


def _region_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the non-reentrant checkpoint region saving its inputs now (see :func:`checkpointed_fn`), or None."""
    for _ in range(10):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in _REGION_FUNCTIONS and code.co_filename == _CHECKPOINT_FILE:
            return frame
        frame = frame.f_back
    return None


def checkpointed_fn(frame: FrameType | None) -> Any:
    """The ``fn`` of the non-reentrant checkpoint that is saving its inputs right now, or None.

    torch saves a region's inputs from inside ``_checkpoint_without_reentrant_generator``
    (or its ``_impl``: ``_REGION_FUNCTIONS``), which is on the call stack only then: while the region runs, the
    generator is suspended at its ``yield``. torch 2.13 and 2.15 save them with ``_CheckpointFrame.save_inputs``,
    2.11 with ``_NoopSaveInputs.apply(dummy, kwargs, *args)`` (a 0-element placeholder first:
    :func:`checkpoint_placeholder`). Private torch internals: if they
    move, those rows fall back to the op that produced the input.
    """
    region = _region_frame(frame)
    return None if region is None else region.f_locals.get("fn")


# torch 2.11: a region saves its inputs as those of an autograd Function, ``_NoopSaveInputs.apply(dummy,
# kwargs, *args)``, with ``dummy = torch.empty((0,), requires_grad=True)`` first among them (so that a region
# without tensor inputs still has a node to hang its hooks on): the saved_tensors_hooks in force pack the
# placeholder too, before the inputs. torch 2.13 and 2.15 save only the inputs (``_CheckpointFrame.save_inputs``)
# and have no ``_NoopSaveInputs``.
_SAVES_PLACEHOLDER = hasattr(torch.utils.checkpoint, "_NoopSaveInputs")


def checkpoint_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t``, being packed by a saved_tensors_hooks' pack now, is the 0-element placeholder a
    torch 2.11 region saves with its inputs (no input of the region, no bytes; always False on 2.13, 2.15).

    Counters of what autograd keeps skip it, so that they count the same on every release."""
    if not _SAVES_PLACEHOLDER or t.numel() != 0 or not t.requires_grad or t.grad_fn is not None:
        return False  # cheap checks first: packs run for every saved tensor
    region = _region_frame(inspect.currentframe())
    return region is not None and region.f_locals.get("dummy") is t


# -- for the soak tool's leak counters (ckpt_tools/soak.py) --

def _hook_dicts_size(namespace: dict[str, Any], prefix: str) -> int:
    # Every hook dict (``_forward_hooks``, ...), not the flag dicts ``_forward_hooks_with_kwargs``
    # and ``_forward_hooks_always_called``, which are keyed by the same hooks.
    return sum(len(v) for k, v in namespace.items() if k.startswith(prefix) and k.endswith("hooks")
               and isinstance(v, dict))


_TENSOR_HOOK_ATTRIBUTES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def hook_count(obj: Any) -> int:
    """Hooks registered on one module, optimizer or tensor.

    torch has no public way to list them: they live in private attributes
    (``module._forward_hooks``, ``optimizer._optimizer_step_pre_hooks``, ...;
    for a tensor ``_backward_hooks`` and ``_post_accumulate_grad_hooks``, C-level
    attributes not in ``__dict__``). ckpt-soak counts them to catch leaked hooks.
    """
    if isinstance(obj, torch.Tensor):
        return sum(len(getattr(obj, a, None) or ()) for a in _TENSOR_HOOK_ATTRIBUTES)
    return _hook_dicts_size(vars(obj), prefix="_")


def global_hook_count() -> int:
    """Hooks in torch's process-wide module and optimizer registries.

    ``register_module_forward_hook`` and friends and ``register_optimizer_step_pre_hook``
    file them in the private module globals ``torch.nn.modules.module._global_*hooks``
    and ``torch.optim.optimizer._global_*hooks``; ckpt-soak counts them to catch leaks
    (``saved_activations`` registers global module hooks for one forward).
    """
    # By name: ``torch.optim`` deletes its ``optimizer`` submodule attribute.
    return sum(_hook_dicts_size(vars(importlib.import_module(table)), prefix="_global_")
               for table in ("torch.nn.modules.module", "torch.optim.optimizer"))


def saved_tensors_hooks_depth() -> int:
    """How many ``saved_tensors_hooks`` are in force (ckpt-soak: none may be left after a step).

    torch has only a private getter for the top of the stack
    (``torch._C._autograd._top_saved_tensors_default_hooks``): pop them all, count, push them back.
    """
    autograd = torch._C._autograd
    popped = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(popped):
        autograd._push_saved_tensors_default_hooks(pack, unpack)
    return len(popped)


def mode_stack_depth() -> int:
    """Dispatch modes plus function modes in force (ckpt-soak: none may be left after a step).

    Private counters (``torch._C._len_torch_dispatch_stack``, ``_len_torch_function_stack``), no public ones.
    """
    return torch._C._len_torch_dispatch_stack() + torch._C._len_torch_function_stack()


# -- for timing a layer on fresh leaves made from its real inputs (planning/timing.py) --

def tree_map(fn: Any, tree: Any) -> Any:
    """``tree`` (nested tuples, lists, dicts) with every leaf replaced by ``fn(leaf)``.

    ``torch.utils._pytree.tree_map``: a private module with a stable API, as ``tree_leaves``.
    """
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(fn, tree)


# -- for torch's own memory-budget checkpointing under compile (ckpt_tools/compiled.py) --

def activation_memory_budget(budget: float) -> Any:
    """Context manager: ``torch._functorch.config.activation_memory_budget = budget`` while in force.

    AOTAutograd's min-cut partitioner reads it when it partitions a compiled
    graph (the first run of a frame, or a recompile), not when the graph runs:
    ``1.0`` (torch's default) saves what is fastest, ``0.0`` recomputes all it
    can, ``0.5`` aims at half of what ``1.0`` keeps beyond the graph's inputs,
    at the fewest recomputed FLOPs. Private config module, no public setter; torch 2.13
    also has ``torch.autograd.graph.region_activation_memory_budget`` (prototype),
    which annotates a traced region instead.
    """
    from torch._functorch import config  # private

    return config.patch(activation_memory_budget=budget)


def compiler_backend(name: str) -> Any:
    """The ``torch.compile`` backend registered as ``name`` (``"inductor"``, ``"aot_eager"``), as a callable.

    ``torch.compile(backend=name)`` looks it up itself; we need the callable to
    wrap it in a backend object of our own (dynamo keeps one compiled frame per
    backend, see ``ckpt_tools/compiled.py``). Lookup is ``torch._dynamo``'s (private).
    """
    from torch._dynamo.backends.registry import lookup_backend  # private

    return lookup_backend(name)


# -- for ckpt.compile's compiled calls (engine/regional.py) --

def compile_failures() -> tuple[type[BaseException], ...]:
    """What ``torch.compile(fn, fullgraph=True)`` raises when ``fn`` does not compile as one graph:
    dynamo's ``Unsupported`` (a graph break) and ``FailOnRecompileLimitHit`` (one graph past
    ``recompile_limit``). Private module ``torch._dynamo.exc``, no public names for them."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported  # private

    return (Unsupported, FailOnRecompileLimitHit)


def recompile_limit_hit(err: BaseException) -> bool:
    """Whether ``err`` (one of :func:`compile_failures`) is the recompile limit, not a graph break."""
    from torch._dynamo.exc import FailOnRecompileLimitHit  # private

    return isinstance(err, FailOnRecompileLimitHit)


@functools.cache
def _compile_takes_recompile_limit() -> bool:
    return "recompile_limit" in inspect.signature(torch.compile).parameters


def compile_with_recompile_limit(fn: Any, backend: str, fullgraph: bool, limit: int) -> Any:
    """``torch.compile(fn, backend=backend, fullgraph=fullgraph)`` that compiles at most ``limit`` graphs for
    ``fn`` (past it, with ``fullgraph``, a call raises ``FailOnRecompileLimitHit``), whatever the global
    ``torch._dynamo.config.recompile_limit``.

    torch 2.13 and 2.15: ``torch.compile`` takes ``recompile_limit=`` and patches the (private) dynamo config
    with it while it compiles a frame of this call (``ConvertFrameAssert``). torch 2.11: no such keyword
    (``TypeError: compile() got an unexpected keyword argument``), and dynamo reads only the global
    ``config.recompile_limit`` (``cache_size.exceeds_recompile_limit``): the returned function patches it the
    same way around each call, which is when dynamo compiles. The config is ``compile_ignored`` (no guard,
    no cache key depends on it). Traced by an outer ``torch.compile`` (a compiled model over compiled layers),
    the call is inlined into the outer graph, as on 2.13, so no patch is made there.
    """
    if _compile_takes_recompile_limit():
        return torch.compile(fn, backend=backend, fullgraph=fullgraph, recompile_limit=limit)
    from torch._dynamo import config as dynamo_config  # private

    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        with dynamo_config.patch(recompile_limit=limit):
            return compiled(*args, **kwargs)

    return limited


def recompile_limit() -> int:
    """``torch._dynamo.config.recompile_limit``: how many graphs dynamo keeps per code object (private config)."""
    import torch._dynamo  # private

    return torch._dynamo.config.recompile_limit


def forget_compiled(fn: Any) -> None:
    """Drop every graph dynamo compiled for ``fn``'s code object (private): a function of ours compiled
    once per plan would otherwise keep each plan's graphs, and guards, for the life of the process."""
    import torch._dynamo.eval_frame  # private

    torch._dynamo.eval_frame.reset_code(fn.__code__)

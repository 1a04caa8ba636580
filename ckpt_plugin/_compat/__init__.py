"""The one place that touches private or moving torch APIs.

Every private torch name the package and its tools use is reached through
this package (``tests/test_compat.py`` has a test per shim, and a test that no
other file imports a private torch module). If a torch release moves one of
these, this package is the only place to change. Tested on the torch the project
declares (``pyproject.toml``). One module per concern; every name is imported
from here (``from ckpt_plugin._compat import user_module``):

- ``fake``: fake tensors, the mode measurement runs in;
- ``ops``: ops as the dispatcher sees them (dispatch modes, schemas, FLOPs);
- ``tensors``: a tensor's storage, version counter, base, and the saved-tensor hooks in force;
- ``pytree``: torch's pytree;
- ``memory``: MemTracker with per-category peaks, ModTracker, a tensor filed as a parameter, the
  end of backward, a batch MemTracker counted;
- ``fsdp``: FSDP (v1) and FSDP2 on fake tensors with fake process groups (a rank's sharded step, measured);
- ``regions``: non-reentrant checkpoint internals (regions opened by hooks, their frames);
- ``checkpoint``: the engine's non-reentrant checkpoint calls, whose early stop survives libraries that re-wrap exceptions;
- ``wrappers``: the user's module inside compile, DDP, FSDP and Fabric wrappers;
- ``dynamo``: torch.compile's internals;
- ``hooks``: hook and mode counters (ckpt-soak), the global module hooks.
"""

from __future__ import annotations

from ckpt_plugin._compat.checkpoint import (
    early_stop_in_force,
    non_reentrant_checkpoint,
    recomputable,
    stop_recomputation_error,
)
from ckpt_plugin._compat.dynamo import (
    activation_memory_budget,
    compile_failures,
    compile_with_recompile_limit,
    compiler_backend,
    forget_compiled,
    recompile_limit,
    recompile_limit_hit,
    tracing_for_compile,
)
from ckpt_plugin._compat.fake import (
    active_fake_mode,
    fake_read_error,
    fake_tensor_mode,
    in_backward,
    is_fake,
    raised_by_fake_tensors,
    reads_values,
)
from ckpt_plugin._compat.fsdp import (
    fake_copy,
    fake_device_mesh,
    fake_process_group,
    fsdp_on_fake_tensors,
    shard_units,
)
from ckpt_plugin._compat.hooks import (
    global_hook_count,
    hook_count,
    mode_stack_depth,
    register_module_forward_hook,
    register_module_forward_pre_hook,
    saved_tensors_hooks_depth,
)
from ckpt_plugin._compat.memory import (
    CategoryPeakTracker,
    MemTracker,
    ModTracker,
    as_parameter,
    at_backward_end,
    seen_bytes,
)
from ckpt_plugin._compat.ops import TorchDispatchMode, argument, beneath_dispatch_modes, is_mutable, op_flops, written
from ckpt_plugin._compat.pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map
from ckpt_plugin._compat.region_generator import close_region
from ckpt_plugin._compat.regions import (
    checkpoint_debug_enabled,
    checkpoint_placeholder,
    checkpointed_fn,
    module_running,
    open_region,
)
from ckpt_plugin._compat.tensors import StorageWeakRef, base_of, outer_saved_tensors_hooks, storage_key, version
from ckpt_plugin._compat.wrappers import checkpoint_wrapper_type, compiled_by_user, uncompiled, user_module

__all__ = [
    "CategoryPeakTracker",
    "MemTracker",
    "ModTracker",
    "StorageWeakRef",
    "TorchDispatchMode",
    "active_fake_mode",
    "activation_memory_budget",
    "argument",
    "as_parameter",
    "at_backward_end",
    "beneath_dispatch_modes",
    "base_of",
    "checkpoint_debug_enabled",
    "checkpoint_placeholder",
    "checkpoint_wrapper_type",
    "checkpointed_fn",
    "close_region",
    "compile_failures",
    "compile_with_recompile_limit",
    "compiled_by_user",
    "compiler_backend",
    "early_stop_in_force",
    "fake_read_error",
    "fake_copy",
    "fake_device_mesh",
    "fake_process_group",
    "fake_tensor_mode",
    "forget_compiled",
    "fsdp_on_fake_tensors",
    "shard_units",
    "global_hook_count",
    "hook_count",
    "in_backward",
    "is_fake",
    "is_mutable",
    "keystr",
    "mode_stack_depth",
    "module_running",
    "non_reentrant_checkpoint",
    "op_flops",
    "open_region",
    "outer_saved_tensors_hooks",
    "raised_by_fake_tensors",
    "reads_values",
    "recompile_limit",
    "recompile_limit_hit",
    "recomputable",
    "register_module_forward_hook",
    "register_module_forward_pre_hook",
    "saved_tensors_hooks_depth",
    "seen_bytes",
    "stop_recomputation_error",
    "storage_key",
    "tracing_for_compile",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "uncompiled",
    "user_module",
    "version",
    "written",
]

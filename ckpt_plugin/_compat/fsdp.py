"""FSDP (v1) and FSDP2 on fake tensors with fake process groups: a rank's sharded step measured without a collective.

:func:`fake_copy` makes the module to shard: its parameters and buffers fake, set into each module's private
``_parameters``/``_buffers``/``_modules`` (``Module.to`` cannot swap a fake parameter in place).

torch's ``FakeProcessGroup`` (private: ``torch._C._distributed_c10d``) is a
process group of any size whose collectives do nothing; with fake tensors the
FSDP wrapping, its all-gathers and reduce-scatters allocate exactly what the real
rank allocates and move no data. Two things stand between it and FSDP (v1) as
torch 2.13 has it, both undone on leaving :func:`fsdp_on_fake_tensors`:

- ``torch.distributed``'s collectives look the group up in the default world's map,
  where a group made outside ``init_process_group`` is not ("is not initialized in
  the world group map"). A call on a fake group returns at once here: the output
  FSDP allocated before the call is all the memory the collective takes.
- ``_flat_param._data_ptr_allocated`` (whether a gathered flat parameter's storage is
  allocated) and ``_flat_param._same_storage`` read ``data_ptr()``, which a fake tensor
  does not have (0, with a warning that it will raise); the storage's size, and the
  storage itself, say the same.

Measured with 2 gloo processes (FULL_SHARD and SHARD_GRAD_OP, AdamW, a block wrap
policy): the fake rank's second step equals the real rank's in every MemTracker
category, to the byte (``tests/test_fit_fsdp.py``).

FSDP2 (``fully_shard``) takes a ``DeviceMesh``, and a mesh's groups are looked up by
name in c10d's registry, which takes only a ``ProcessGroup``: :func:`fake_device_mesh`
makes one per dimension around a ``FakeProcessGroup`` backend, registered under a name of
its own (unregistered when the mesh is collected), and the collectives above return at once
on them too. It is built on the real mesh's layout without any collective, so rank 0 can
make it alone while the other ranks wait.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ckpt_plugin._compat.ops import beneath_dispatch_modes

# What FSDP (v1) calls (``_runtime_utils``, ``_flat_param``, ``fully_sharded_data_parallel``), and their older names.
_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                "_all_gather_base", "_reduce_scatter_base", "all_reduce", "all_gather", "broadcast", "barrier")


def fake_copy(module: torch.nn.Module, mode: Any, dtype: torch.dtype | None = None,
              device: torch.device | None = None) -> tuple[torch.nn.Module, dict[int, torch.nn.Module]]:
    """A copy of ``module`` with fake parameters and buffers (``mode``'s; floating ones in ``dtype``, all on
    ``device``, if given) and every other attribute shared; and the map from each module's id to its copy. Tied
    parameters stay tied; hooks are copied, so hooks put on the copy (FSDP's) stay off the module."""
    copies: dict[int, torch.nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in tensors:
            copy = mode.from_tensor(t)  # a Parameter stays a Parameter, its requires_grad kept
            to_dtype = dtype if dtype is not None and t.is_floating_point() and t.dtype != dtype else t.dtype
            to_device = device if device is not None and t.device != device else t.device
            if (to_dtype, to_device) != (t.dtype, t.device):
                with mode:
                    converted = copy.detach().to(device=to_device, dtype=to_dtype)
                parameter = isinstance(t, torch.nn.Parameter)
                copy = torch.nn.Parameter(converted, t.requires_grad) if parameter else converted
            tensors[id(t)] = copy
        return tensors[id(t)]

    def copy_of(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in copies:
            return copies[id(m)]
        new = type(m).__new__(type(m))  # not copy.copy: LightningModule.__getstate__ drops the trainer
        new.__dict__.update(m.__dict__)
        copies[id(m)] = new
        for key, value in m.__dict__.items():
            if isinstance(value, dict | set) and key.startswith("_"):  # hooks, _non_persistent_buffers_set, ...
                new.__dict__[key] = type(value)(value)
        new._parameters = {k: fake(p) for k, p in m._parameters.items()}
        new._buffers = {k: fake(b) for k, b in m._buffers.items()}
        new._modules = {k: copy_of(c) if c is not None else None for k, c in m._modules.items()}
        return new

    return copy_of(module), copies


def fake_process_group(rank: int, world_size: int) -> Any:
    """A process group of ``world_size`` ranks, this one ``rank``, whose collectives do nothing."""
    from torch._C._distributed_c10d import FakeProcessGroup  # private

    create = getattr(FakeProcessGroup, "_create_internal", None)  # newer torch: the constructor is not bound
    return create(rank, world_size) if create is not None else FakeProcessGroup(rank, world_size)


_MESH_GROUPS: set[str] = set()  # the names fake_device_mesh registered, until its mesh is collected
_NUMBER = itertools.count()


def _registered_fake_group(rank: int, size: int) -> Any:
    """A ``ProcessGroup`` of ``size`` ranks, this one ``rank``, on a ``FakeProcessGroup`` backend, registered by
    name in c10d's map (private: where DeviceMesh finds its groups; it holds them weakly)."""
    from torch._C._distributed_c10d import ProcessGroup, _register_process_group  # private

    group = ProcessGroup(dist.HashStore(), rank, size)
    backend = fake_process_group(rank, size)
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
    name = f"ckpt_fake_mesh_{next(_NUMBER)}"
    group._set_group_name(name)
    _register_process_group(name, group)
    _MESH_GROUPS.add(name)
    return group


def _unregister(names: list[str]) -> None:
    from torch._C._distributed_c10d import _unregister_process_group  # private

    for name in names:
        _MESH_GROUPS.discard(name)
        _unregister_process_group(name)


def fake_device_mesh(like: Any) -> Any:
    """A ``DeviceMesh`` with ``like``'s layout, dimension names and device type, this rank where it is in ``like``,
    each dimension's group fake (the collectives in :func:`fsdp_on_fake_tensors` move nothing on it)."""
    from torch.distributed.device_mesh import DeviceMesh

    with beneath_dispatch_modes():  # the mesh's own tensor of ranks is read for its layout: never fake
        coordinate = like.get_coordinate()
        groups = [_registered_fake_group(coordinate[dim], size) for dim, size in enumerate(like.mesh.shape)]
        mesh = DeviceMesh(like.device_type, like.mesh, mesh_dim_names=like.mesh_dim_names, _init_backend=False)
    names = [group.group_name for group in groups]
    mesh._dim_group_names = names  # private: where DeviceMesh keeps the name of each dimension's group
    mesh._pg_registry = dict(zip(names, groups, strict=True))  # private: c10d's map holds them weakly; the mesh keeps them
    weakref.finalize(mesh, _unregister, names)
    return mesh


def shard_units(module: torch.nn.Module) -> frozenset[str]:
    """The qualified names of ``module``'s modules that FSDP gathers as units of their own: FSDP2's
    ``fully_shard``-ed modules, and the modules FSDP (v1) wraps (``<name>._fsdp_wrapped_module``)."""
    from torch.distributed.fsdp import FSDPModule

    return frozenset(name for name, m in module.named_modules()
                     if isinstance(m, FSDPModule) or name.rpartition(".")[2] == "_fsdp_wrapped_module")


def _is_fake_group(group: Any) -> bool:
    from torch._C._distributed_c10d import FakeProcessGroup  # private

    return isinstance(group, FakeProcessGroup) or getattr(group, "group_name", None) in _MESH_GROUPS


def _skipping_fake_groups(collective: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if any(_is_fake_group(a) for a in (kwargs.get("group"), *args)):
            return None  # its outputs were allocated by the caller, and fake: nothing to move
        return collective(*args, **kwargs)

    return call


@contextlib.contextmanager
def fsdp_on_fake_tensors() -> Iterator[None]:
    """FSDP (v1) with a :func:`fake_process_group`, FSDP2 with a :func:`fake_device_mesh`, run on fake tensors
    inside; as it was outside."""
    from torch.distributed.fsdp import _flat_param  # private

    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    from torch.multiprocessing.reductions import StorageWeakRef

    readers = {  # what replaces each where this torch has it
        "_data_ptr_allocated": lambda tensor: tensor.untyped_storage().nbytes() > 0,
        "_same_storage": lambda a, b: StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage()),
    }
    kept = {name: getattr(_flat_param, name) for name in readers if hasattr(_flat_param, name)}
    try:
        for name, collective in saved.items():
            setattr(dist, name, _skipping_fake_groups(collective))
        for name in kept:
            setattr(_flat_param, name, readers[name])
        yield
    finally:
        for name, collective in saved.items():
            setattr(dist, name, collective)
        for name, reader in kept.items():
            setattr(_flat_param, name, reader)


__all__ = ["fake_copy", "fake_device_mesh", "fake_process_group", "fsdp_on_fake_tensors", "shard_units"]

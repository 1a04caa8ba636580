"""The copies behind offloading: out to host memory on a side stream, back ahead of use in backward.

    offloader = Offloader()                 # one per installation: every offloaded layer of a model shares it
    call = offloader.begin()                # a layer's call starts (forward): its first copy
    copy = offloader.copy_out(t, call)      # a saved storage to host memory
    offloader.end(call)                     # the call ends: calls more than `ahead` before it leave the device
    t = offloader.bring_back(copy, layout)  # backward: its call's bytes, and the next calls' ahead of use
    offloader.free()                        # remove_checkpointing: the host pool goes

What overlaps what, on CUDA (the copies alone, one after the other, took 805 ms of
a 1,109 ms step when nothing overlapped; docs/gpu.md):

- **Out, in forward.** Each copy runs on a side stream that first waits for the
  compute stream (the copy reads finished data). The compute stream is captured
  *before* switching to the side stream: inside ``torch.cuda.stream(s)``,
  ``current_stream()`` is ``s`` (the trap torchtitan's async offload found).
  The source stays referenced (stashed) until a later call ends: then the compute
  stream waits for its copy and lets it go, so its block returns to the compute
  stream's pool in stream order (no ``record_stream``, whose blocks come back only
  when the allocator next polls events: memory the host cannot bound). At the end
  of each call, the calls more than :attr:`Offloader.ahead` before it are let go:
  at most ``ahead`` calls' bytes stay on the device beside the running layer, in
  the allocator's own order, which is what the planner's peak counts
  (``planning/offload_plan.py``), and each copy has the next calls' forward to hide
  behind. The last ``ahead`` calls are still stashed when backward begins; then
  they are let go too. What backward unpacks always comes from the host copy,
  made when the tensor was saved: the source may have been written in place since
  (a selective policy's saved output that the region goes on to change, HF Funnel),
  and a version counter made beneath autograd does not say so.
- **Back, in backward.** Autograd unpacks a call's saved tensors when its layer's
  backward starts. Then that call's bytes come back (if not already here) and so
  do the next ``ahead`` calls' in backward order (the calls before it in forward),
  on a second stream, each after its own copy out has finished. Each device
  tensor is allocated on that stream and recorded on the compute stream
  (``record_stream``), and the compute stream waits on its arrival event only
  when the tensor is unpacked: backward does not wait for copies it does not yet
  need (torchtitan#2379; torch's compiled offload added reload prefetch for the
  same reason, pytorch#168316).
- **Host memory** comes from a :class:`~ckpt_plugin.engine.host_pool.HostPool`,
  pinned, reused from the second step on. Before a step's first copy out reuses
  the pool, the side stream waits for the last step's copies back: they read
  the regions it is about to overwrite.

On a CPU-only machine the same sequence runs with plain copies (tests force it:
``Offloading._in_host_memory``), so the order of copies, prefetches and the pool's
reuse are tested where there is no GPU; only overlap and the allocator need one.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_plugin._compat import beneath_dispatch_modes, is_fake
from ckpt_plugin.engine.host_pool import HostPool

PREFETCH_AHEAD = 1  # calls whose bytes may be on the device beside the running one: in flight out, or prefetched back


@dataclass
class CopyStats:
    """What an :class:`Offloader` has done, over its life: for tests and the GPU check."""

    copies_out: int = 0
    bytes_out: int = 0
    prefetched: int = 0  # storages brought back ahead of their unpack (a later call's, in backward order)
    on_demand: int = 0  # storages brought back at their own unpack: the first of a backward, or re-read


def whole_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole storage as (nbytes,) uint8, a view (on fake tensors too: no ``set_``)."""
    flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return flat.view(torch.uint8)


class _Streams:
    """A device's two copy streams: out (device to host) and back (host to device)."""

    def __init__(self, device: torch.device) -> None:
        self.out = torch.cuda.Stream(device)
        self.back = torch.cuda.Stream(device)
        self.pool_generation = -1  # the pool's start-overs when ``out`` last waited for ``back``


class _Call:
    """One offloaded call of a layer in one step: its copies (weakly), in the order they were made."""

    __slots__ = ("copies", "fetched", "stashed", "before", "__weakref__")

    def __init__(self, before: _Call | None) -> None:
        # The call before it in forward order (weakly: a call lives as long as its copies), for backward's prefetch.
        self.before: weakref.ref[_Call] | None = weakref.ref(before) if before is not None else None
        self.copies: list[weakref.ref[HostCopy]] = []
        self.fetched = False  # its copies have been sent back (prefetched or on demand)
        self.stashed = True  # its sources are still referenced on the device (until a later call ends)

    def alive(self) -> list[HostCopy]:
        return [c for ref in self.copies if (c := ref()) is not None]


class HostCopy:
    """The bytes of one device storage in host memory, the event that says they are there, and the way back."""

    __slots__ = ("host", "device", "nbytes", "call", "ready", "on_device", "arrived", "packs", "unpacks",
                 "source", "_restored", "_pool", "__weakref__")

    def __init__(self, host: torch.Tensor | None, device: torch.device, call: _Call, pool: HostPool | None,
                 nbytes: int | None = None) -> None:
        self.host, self.device, self.call, self._pool = host, device, call, pool  # host None: a fake tensor's
        self.nbytes = host.numel() if host is not None else nbytes
        self.ready: torch.cuda.Event | None = None  # recorded after the copy out (CUDA)
        self.on_device: torch.Tensor | None = None  # (nbytes,) uint8 on the device, once brought back
        self.source: torch.Tensor | None = None  # the storage copied, (nbytes,) uint8, while its call is stashed
        self.arrived: torch.cuda.Event | None = None  # recorded after the copy back (CUDA)
        self.packs = 0  # saved tensors packed as views of it
        self.unpacks = 0
        self._restored: weakref.ref[torch.Tensor] | None = None  # the (nbytes,) uint8 the views given out are of

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.give_back()


class Offloader:
    """What every offloaded call of one installation shares: the host pools, the copy streams, the step's calls.

    ``ahead``: calls in flight beside the running one, out in forward and back in
    backward (:data:`PREFETCH_AHEAD`); the planner's peak counts them.
    """

    def __init__(self, ahead: int = PREFETCH_AHEAD) -> None:
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ckpt.offload: ahead must be a whole number of calls >= 0, got {ahead!r}")
        self.ahead = ahead
        self.pools = {pinned: HostPool(pinned) for pinned in (False, True)}
        self.stats = CopyStats()
        self._streams: dict[torch.device, _Streams] = {}
        self._last: weakref.ref[_Call] | None = None  # the call begun last (each links to the one before)
        self._stashed: collections.deque[_Call] = collections.deque()  # calls whose sources are still referenced

    @property
    def host_allocations(self) -> int:
        """Host allocations the pools have made, ever: after the first step, none."""
        return sum(p.allocations for p in self.pools.values())

    def free(self) -> None:
        """Let go of the host memory (``remove_checkpointing``); copies still alive keep their own regions."""
        for pool in self.pools.values():
            pool.free()
        self._last = None
        self._stashed.clear()

    # -- forward ---------------------------------------------------------------------------

    def begin(self) -> _Call:
        """A call starts, after the one begun last (a call of the step before has no copy left by then: its
        backward freed them, so backward never reaches back into it)."""
        call = _Call(self._last() if self._last is not None else None)
        self._last = weakref.ref(call)
        self._stashed.append(call)
        return call

    def end(self, call: _Call) -> None:
        """A call ends: the calls more than ``ahead`` before it leave the device, the compute stream waiting for
        their copies out first (a stashed source is then free to reuse, in the compute stream's order)."""
        while len(self._stashed) > self.ahead:
            self._let_go(self._stashed.popleft())

    def _let_go(self, call: _Call) -> None:
        call.stashed = False
        for copy in call.alive():
            if copy.ready is not None:
                torch.cuda.current_stream(copy.device).wait_event(copy.ready)
            copy.source = None

    def copy_out(self, t: torch.Tensor, call: _Call) -> HostCopy:
        """``t``'s whole storage in host memory, queued (CUDA) or done (elsewhere). A fake tensor (a plan's step
        measured, ``measure/fake.py``) is only let go: its bytes come back as a fresh fake tensor, allocated
        when they would be, so that measurements see the device's side of offload."""
        src = whole_storage(t.detach())  # (nbytes,) uint8, outside autograd
        if is_fake(t):
            copy = HostCopy(None, t.device, call, None, src.numel())
        else:
            pool = self.pools[t.is_cuda]
            with beneath_dispatch_modes():  # host memory: no device bytes for a tracker to count
                copy = HostCopy(pool.take(src.numel()), t.device, call, pool)
        call.copies.append(weakref.ref(copy))
        copy.source = src  # stashed until a later call ends (``end``), or backward begins
        if copy.host is None:  # a fake tensor's: measured, not copied (the stats count copies made)
            return copy
        self.stats.copies_out += 1
        self.stats.bytes_out += copy.nbytes
        if not t.is_cuda:
            with beneath_dispatch_modes():
                copy.host.copy_(src)
            return copy
        compute = torch.cuda.current_stream(t.device)  # captured before switching streams
        streams = self._streams_of(t.device)
        streams.out.wait_stream(compute)  # the producer has written src
        if streams.pool_generation != pool.started_over:  # the pool starts over: last step's copies back read it
            streams.out.wait_stream(streams.back)
            streams.pool_generation = pool.started_over
        with torch.cuda.stream(streams.out), beneath_dispatch_modes():
            copy.host.copy_(src, non_blocking=True)
        copy.ready = streams.out.record_event()  # the compute stream waits on it before letting src go
        return copy

    # -- backward --------------------------------------------------------------------------

    def bring_back(self, copy: HostCopy, dtype: torch.dtype, offset: int, size: torch.Size,
                   stride: tuple[int, ...]) -> torch.Tensor:
        """The saved tensor on its device again; its call's bytes, and the next ``ahead`` calls' in backward
        order, sent back now if they were not yet. Views unpacked by the same node share one copy back."""
        copy.unpacks += 1
        while self._stashed:  # backward has begun: no source is needed on the device any more
            self._let_go(self._stashed.popleft())
        alive = copy._restored() if copy._restored is not None else None
        compute = torch.cuda.current_stream(copy.device) if copy.device.type == "cuda" else None
        if alive is not None:
            raw = alive
        else:
            if copy.on_device is None:
                if copy.call.fetched:  # brought back before and let go (a second backward): again, now
                    self.stats.on_demand += 1
                    self._send_back(copy, compute)
                else:
                    self._fetch(copy.call, compute, on_demand=True)
            self._fetch_ahead(copy.call, compute)
            if copy.arrived is not None:
                compute.wait_event(copy.arrived)  # only now does backward need these bytes
                copy.arrived = None
            raw = copy.on_device
        if is_fake(raw):  # a measured step: a fake storage cannot be set on another tensor, a view stands for it
            view = raw.view(dtype).as_strided(size, stride, offset)
        else:  # not a view (no ``_base``): a selective recomputation returns it, and writes into it in place
            view = torch.empty(0, dtype=dtype, device=copy.device).set_(raw.untyped_storage(), offset, size, stride)
        copy._restored = weakref.ref(raw)
        if copy.unpacks >= copy.packs:  # every view packed has been unpacked: autograd holds what it needs
            copy.on_device = None
        return view

    def _fetch_ahead(self, call: _Call, compute: Any) -> None:
        earlier = call
        for _ in range(self.ahead):
            earlier = earlier.before() if earlier.before is not None else None
            if earlier is None:
                return
            if not earlier.fetched and not earlier.stashed:
                self._fetch(earlier, compute, on_demand=False)

    def _fetch(self, call: _Call, compute: Any, on_demand: bool) -> None:
        call.fetched = True
        for copy in call.alive():
            if copy.on_device is None:
                self._send_back(copy, compute)
                if on_demand:
                    self.stats.on_demand += 1
                else:
                    self.stats.prefetched += 1

    def _send_back(self, copy: HostCopy, compute: Any) -> None:
        if compute is None or copy.host is None:  # not CUDA: a plain copy; a fake tensor's: allocated only
            copy.on_device = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
            if copy.host is not None:
                copy.on_device.copy_(copy.host)
            return
        back = self._streams_of(copy.device).back
        if copy.ready is not None:
            back.wait_event(copy.ready)  # the bytes are in host memory
        with torch.cuda.stream(back):
            on_device = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
            on_device.copy_(copy.host, non_blocking=True)
        on_device.record_stream(compute)  # allocated on ``back``, used on the compute stream
        copy.on_device, copy.arrived = on_device, back.record_event()

    def _streams_of(self, device: torch.device) -> _Streams:
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        return self._streams[device]


__all__ = ["CopyStats", "HostCopy", "Offloader", "PREFETCH_AHEAD"]

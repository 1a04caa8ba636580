"""Host memory for offloaded activations: grown to one step's need on the first step, reused after it.

    pool = HostPool(pinned=True)
    region = pool.take(nbytes)       # (nbytes,) uint8, a view into one of the pool's slabs
    pool.give_back()                 # when what was copied there is no longer needed
    pool.allocations                 # host allocations made so far: none after the first step
    pool.free()                      # remove_checkpointing, teardown

Why a pool: pinning host memory (``cudaHostAlloc``) is slow and synchronises the
device, so a fresh pinned buffer per saved storage per step serialises the copy
stream with the compute stream. torchtune's ``OffloadActivations`` users found
exactly this (torchtune#2076), and torchtitan's async offload moved to one
pre-allocated pinned slab for that reason (torchtitan PR #2581).

How: a bump allocator over slabs. A step's regions are handed out one after the
other; once every region is given back (the step's backward has freed its
saved tensors), the next region starts again at the beginning. On the first
step the pool grows slab by slab (each at least twice what it holds, so a few
allocations in all); when that step's regions are all back and it took more
than one slab, the slabs are replaced by one of the step's whole need. From the
second step on a step of the same shapes takes no host allocation. Regions are
aligned to :data:`ALIGN` bytes, enough for every dtype and for DMA.

A region is never handed out twice within a step: bytes copied out early in the
forward stay until backward has read them. Reuse across steps is safe on CUDA
because the caller orders the next step's first device-to-host copy after the
last step's host-to-device copies (``offload_copies.Offloader``); freeing a slab
is safe because torch's pinned-memory allocator holds a block until the copies
recorded on it have run.
"""

from __future__ import annotations

import torch

ALIGN = 512  # bytes between region starts: every dtype's alignment, and what DMA engines like
_FIRST_SLAB = 1 << 20  # the least slab: a step of small copies does not allocate per copy


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN` (at least one :data:`ALIGN`)."""
    return max(-(-nbytes // ALIGN), 1) * ALIGN


class HostPool:
    """Slabs of host memory (pinned where ``pinned``), handed out as regions and reused step after step."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.slabs: list[torch.Tensor] = []  # each (bytes,) uint8 in host memory
        self._slab, self._offset = 0, 0  # where the next region starts
        self.live = 0  # regions handed out and not given back
        self.used = 0  # bytes handed out since the pool last started over (aligned)
        self.need = 0  # the most bytes one step (regions handed out between two start-overs) took
        self.allocations = 0  # host allocations made (slabs), ever
        self.allocated_bytes = 0  # their bytes, ever
        self.started_over = 0  # how often the pool has started over: steps, as the pool sees them

    @property
    def held_bytes(self) -> int:
        """Host bytes the pool holds now."""
        return sum(s.numel() for s in self.slabs)

    def take(self, nbytes: int) -> torch.Tensor:
        """A region of ``nbytes`` host bytes (uint8), valid until given back."""
        size = aligned(nbytes)
        while self._slab < len(self.slabs) and self._offset + size > self.slabs[self._slab].numel():
            self._slab, self._offset = self._slab + 1, 0
        if self._slab == len(self.slabs):
            self.slabs.append(self._allocate(max(size, _FIRST_SLAB, 2 * self.held_bytes)))
            self._offset = 0
        region = self.slabs[self._slab][self._offset:self._offset + nbytes]
        self._offset += size
        self.live += 1
        self.used += size
        self.need = max(self.need, self.used)
        return region

    def give_back(self) -> None:
        """One region is no longer needed; with the last of a step's, the pool starts over (one slab, if grown)."""
        self.live -= 1
        if self.live == 0:
            self._start_over()

    def free(self) -> None:
        """Drop every slab (``remove_checkpointing``, teardown); a later step grows the pool again."""
        self.slabs = []
        self._slab, self._offset, self.used, self.need = 0, 0, 0, 0

    def _start_over(self) -> None:
        if len(self.slabs) > 1:  # grown slab by slab: one slab of the step's whole need from now on
            self.slabs = []
            self.slabs.append(self._allocate(self.need))
        self._slab, self._offset, self.used = 0, 0, 0
        self.started_over += 1

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)


__all__ = ["ALIGN", "HostPool", "aligned"]

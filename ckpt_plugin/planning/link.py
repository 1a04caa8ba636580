"""The host link offload would use, measured where the plan is made: pinned copies each way, as the GPU check does.

    link = measure_link(torch.device("cuda"))   # Link(out_bytes_per_s=..., back_bytes_per_s=..., how=...)
    measure_link(torch.device("cpu"))            # None: host memory is where the tensors are already

What the plan prices offload's copies at (``offload_plan.py``). A few copies of
:data:`PROBE_BYTES`, the fastest of them each way: the figure the link reaches
unloaded, which the copies of a step (each of a layer's storages, a few MiB to a
GiB) approach. On the H100 the GPU check met, 1 GiB copies gave 54.8 GB/s out
and 54.6 GB/s back (docs/gpu.md).
"""

from __future__ import annotations

import torch

from ckpt_plugin.planning.offload_plan import Link, no_link_line

PROBE_BYTES = 64 << 20  # per copy: large enough that the copy's fixed cost is a small part of it
_REPEATS = 3


def measure_link(device: torch.device, nbytes: int = PROBE_BYTES, repeats: int = _REPEATS) -> Link | None:
    """``device``'s link to pinned host memory, each way; None where there is none to measure (not CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = {"out": float("inf"), "back": float("inf")}
    stream = torch.cuda.current_stream(device)
    for round_ in range(repeats + 1):  # round 0 warms up
        for way, (dst, src) in (("out", (host, on_device)), ("back", (on_device, host))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            if round_:
                best[way] = min(best[way], start.elapsed_time(end) / 1e3)
    name = f"{device.type}:{device.index if device.index is not None else torch.cuda.current_device()}"
    return Link(nbytes / best["out"], nbytes / best["back"],
                f"measured on {name} with pinned copies of {nbytes >> 20} MiB, the fastest of {repeats}")


def host_link(device: torch.device, allowed: bool = True) -> tuple[Link | None, str]:
    """(the link offload is priced on, or None) and the line a plan says where there is none."""
    if not allowed:
        return None, "offload: not an option: ckpt.offload=false"
    link = measure_link(device)
    return link, "" if link is not None else no_link_line(device.type)


__all__ = ["PROBE_BYTES", "host_link", "measure_link"]

"""Peak-memory measurement shared by the kernel benchmarks: CUDA's allocator statistics on GPU, the
profiler's allocation trace (its running "Total Allocated") on CPU. Measures only what the measured
function allocates; tensors that exist before it runs are not counted.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated by fn() above what was allocated when it started (fn's result is dropped)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def saved_for_backward_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """(fn(), bytes of the tensors autograd saved for the backward while fn ran): activation memory.

    Counts each storage once, so views of one tensor are not double counted."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


def warm_up_profiler() -> None:
    """The first CPU profile in a process costs seconds of setup; pay it before measuring."""
    peak_allocated_bytes(lambda: torch.zeros(1))


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:9.1f}"

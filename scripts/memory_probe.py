"""Memory measures of :mod:`benchmark`'s probe processes: the resident set from ``/proc`` and the
tensors' peak from the CPU allocator's own count (the profiler's memory events)."""

import json
import os
import tempfile
from typing import Callable

from torch.profiler import ProfilerActivity, profile


def status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def allocated_peak_mib(run: Callable[[], None]) -> float:
    """The most bytes of tensors allocated on CPU while ``run()`` runs, above those held before
    (MiB; what ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` is on a GPU): the
    largest "Total Allocated" of the profiler's memory events, which counts the allocations made
    while it runs, each until freed."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals]) / 2 ** 20

"""How often one private step reads a tensor's value on the host: on a GPU each read waits for the
device's queued work, so the Python bookkeeping no longer overlaps the kernels.

    python scripts/count_host_reads.py [--models convnet,sequence] [--modes bk,bk-per-layer,ghost,hooks]

Per model and mode (the benchmark models of ``scripts/benchmark.py``, their batches cut to
``--batch-size``), the reads of one step after a warm-up step: scalar reads (``aten::_local_scalar_dense``:
``bool()``, ``.item()``, ``float()``; ``aten::equal``), counted by a dispatch mode, and the batched
reads of the ghost norms' deferred rounding checks (``bookkeeping/deferred_checks.py``, one
transfer per device, counted by wrapping it). Counted on CPU, where the same code runs but for
one check: whether a clipped sum must drop samples (a zero or non-finite factor) is read on CPU
only (other devices assume it), so per-layer clipping reads more here than on a GPU.
"""

import argparse
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import build_step  # noqa: E402
from benchmark_models import WORKLOADS  # noqa: E402
from opacus_dp.grad_sample.bookkeeping import deferred_checks  # noqa: E402

SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default)


class _ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in SCALAR_READS
        return func(*args, **(kwargs or {}))


def count_reads(model_name: str, mode: str, batch_size: int) -> dict:
    """``{"scalar": …, "batched": …}`` host reads of one step of ``mode`` on ``model_name``."""
    torch.manual_seed(1)
    x, y = WORKLOADS[model_name].batch()
    step = build_step(WORKLOADS[model_name], mode, x[:batch_size], y[:batch_size])
    step()  # warm-up: lazy set-up reads nothing twice
    batched, original = [0], deferred_checks._read_flags

    def counted(flags):
        batched[0] += 1
        return original(flags)
    deferred_checks._read_flags = counted
    try:
        with _ScalarReads() as scalar:
            step()
    finally:
        deferred_checks._read_flags = original
    return {"scalar": scalar.count, "batched": batched[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default="bk,bk-per-layer,ghost,hooks")
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"{'model':<12} {'mode':<14} {'scalar reads':>12} {'batched reads':>13}")
    for model_name in args.models.split(","):
        for mode in args.modes.split(","):
            reads = count_reads(model_name, mode, args.batch_size)
            print(f"{model_name:<12} {mode:<14} {reads['scalar']:>12} {reads['batched']:>13}")


if __name__ == "__main__":
    main()

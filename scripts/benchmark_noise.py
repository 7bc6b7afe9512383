#!/usr/bin/env python
"""Cost of drawing the Gaussian noise of one step on CPU, against an ``add_`` of the same size.

For each size (default 1 M and 16.8 M float32 coordinates), side by side in interleaved rounds:

* ``torch.normal``: the default noise (:class:`~opacus_dp.optim.noise.GaussianNoise`), one
  generator on one thread, into a new tensor (``normal_ (preallocated)``: into an existing one,
  which leaves out the page faults of a freshly mapped tensor);
* ``parallel``: :class:`~opacus_dp.optim.parallel_noise.ParallelGaussianNoise`'s ``sample`` into a
  new tensor, with ``--threads`` threads (default ``torch.get_num_threads()``) and with one;
* ``parallel fused``: its ``add_sample_``, the noise added in place into the clipped sum, chunk by
  chunk (no new tensor, no second pass);
* ``philox``: :class:`~opacus_dp.optim.philox_noise.PhiloxGaussianNoise` (``fast_noise="philox"``):
  ``sample`` into a new tensor; ``philox noised``: ``noised(sum)``, a new tensor ``sum + noise`` in
  one pass (what the optimizer's step calls); ``philox fused``: ``add_sample_``, in place;
  ``philox secure``: ``noised`` in secure mode (four draws per coordinate);
* ``add_``: ``sum.add_(noise)``, the pass the optimizer adds after the draw;
* ``normal + add_`` and ``parallel + add_``: what the step does now with each mechanism.

Times are wall-clock medians over ``--repeats`` rounds, each also ÷ the ``add_`` median; ``cpu ms``
is the median process CPU time (all threads together: near the wall time when the threads did
not run side by side, e.g. on a machine whose other cores are busy). Shared machines are noisy:
compare the ratios of one run, not single times across runs.

Usage: ``python scripts/benchmark_noise.py [--sizes 1048576 16777216] [--repeats 15] [--threads N]``
"""

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
from opacus_dp.optim.philox import native
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise


def timed(fn: Callable[[], object]) -> Tuple[float, float]:
    """Wall-clock and process CPU seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def variants(size: int, threads: int) -> Dict[str, Callable[[], object]]:
    """The operations timed for ``size`` coordinates (each draws a fresh step's noise)."""
    generator = torch.Generator().manual_seed(0)
    total, noise = torch.randn(size), torch.randn(size)
    parallel = ParallelGaussianNoise(seed=1, num_threads=threads)
    serial = ParallelGaussianNoise(seed=1, num_threads=1)
    philox = PhiloxGaussianNoise(seed=1, num_threads=threads)
    secure = PhiloxGaussianNoise(secure_mode=True, num_threads=threads)

    def fresh(mechanism):
        mechanism.begin_step(torch.device("cpu"))
        return mechanism

    return {
        "torch.normal": lambda: torch.normal(0.0, 1.0, size=(size,), generator=generator),
        "normal_ (preallocated)": lambda: noise.normal_(0.0, 1.0, generator=generator),
        f"parallel ({threads} threads)": lambda: fresh(parallel).sample(total, 1.0),
        "parallel (1 thread)": lambda: fresh(serial).sample(total, 1.0),
        f"parallel fused ({threads} threads)": lambda: fresh(parallel).add_sample_(total, 1.0),
        f"philox ({threads} threads)": lambda: fresh(philox).sample(total, 1.0),
        f"philox noised ({threads} threads)": lambda: fresh(philox).noised(total, 1.0),
        f"philox fused ({threads} threads)": lambda: fresh(philox).add_sample_(total, 1.0),
        f"philox secure ({threads} threads)": lambda: fresh(secure).noised(total, 1.0),
        "add_": lambda: total.add_(noise),
        "normal + add_": lambda: torch.normal(0.0, 1.0, size=(size,), generator=generator).add_(total),
        f"parallel + add_ ({threads} threads)": lambda: fresh(parallel).sample(total, 1.0).add_(total),
    }


def measure(size: int, threads: int, repeats: int) -> Dict[str, Tuple[float, float]]:
    """Median wall-clock and CPU milliseconds of each variant over ``repeats`` interleaved rounds
    (after one warm-up round)."""
    ops = variants(size, threads)
    times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in ops}
    for round_index in range(repeats + 1):
        for name, fn in ops.items():
            elapsed = timed(fn)
            if round_index:
                times[name].append(elapsed)
    return {name: (1e3 * statistics.median(w for w, _ in values), 1e3 * statistics.median(c for _, c in values))
            for name, values in times.items()}


def report(size: int, medians: Dict[str, Tuple[float, float]]) -> List[str]:
    add = medians["add_"][0]
    lines = [f"{size:,} float32 coordinates ({size * 4 / 2**20:.1f} MiB)",
             f"  {'variant':34s} {'median ms':>10s} {'÷ add_':>8s} {'cpu ms':>8s}"]
    lines += [f"  {name:34s} {wall:10.2f} {wall / add:8.2f} {cpu:8.2f}" for name, (wall, cpu) in medians.items()]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="default: torch.get_num_threads()")
    parser.add_argument("--json", default=None, help="also write the medians to this file")
    args = parser.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"os.cpu_count() = {os.cpu_count()}, parallel noise with {threads} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native Philox kernel: "
          f"{native.unavailable_reason() or 'built'}")
    results = {}
    for size in args.sizes:
        results[size] = measure(size, threads, args.repeats)
        print("\n".join(report(size, results[size])))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({str(size): medians for size, medians in results.items()}, handle, indent=2)


if __name__ == "__main__":
    main()

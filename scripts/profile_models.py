"""Where the time of a private step goes on the single-device benchmark models, phase by phase.

For each model of ``scripts/benchmark.py`` (``--models``), side by side in one process: the
non-private SGD step and ``make_private`` in each ``--modes`` (σ = 1, C = 1, the benchmark's
batches). The private optimizer's phases are timed by wrapping its methods on the instance
(:func:`profile_step.instrument`; nothing in the package is changed): ``forward``, ``backward``
(``bk`` forms its per-sample norms there), ``clip`` (norms gathered, clip factors, clipped sums),
``noise`` (drawing and adding it), ``scale`` (the mean's division, ``p.grad``), ``inner`` (SGD's
update) and ``other`` (checks, accountant). Median process CPU milliseconds over ``--steps``
steps, interleaved with the non-private step (``--timer wall``: wall-clock milliseconds, for
several threads, where process CPU time sums the threads' work and hides what runs on one).
``--batch-size 2`` keeps the first two samples of each batch: the per-sample work is then
negligible and what remains above the non-private step is the step's fixed cost (hooks,
bookkeeping, clip factors, noise of the model's size). ``--compile BACKEND`` compiles every
setting's model in place (``model.compile(backend=...)``, after ``make_private`` for the private
ones, as ``scripts/benchmark.py --compile`` does): ``forward`` and ``backward`` are then the
compiled graphs with the per-sample work the backward pass does eagerly (docs/compile.md).

    OMP_NUM_THREADS=1 python scripts/profile_models.py --steps 9 [--fast-noise philox] [--batch-size 2]
    OMP_NUM_THREADS=1 python scripts/profile_models.py --models convnet,lstm --compile inductor
    OMP_NUM_THREADS=2 python scripts/profile_models.py --models llama --threads 2 --timer wall
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.engine.fast_noise import FAST_NOISE_NAMES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import _batch, _ours  # noqa: E402
from benchmark_models import WORKLOADS  # noqa: E402
from profile_step import instrument, step_phases, table  # noqa: E402

CLOCKS = {"cpu": (time.process_time, "process CPU"), "wall": (time.perf_counter, "wall-clock")}


def build(workload, mode, x, y, fast_noise, backend=None):
    """``(model, optimizer, criterion, phase times)`` of the non-private (``mode=None``) or private
    step, its model compiled by ``backend`` if given."""
    import opacus_dp.layers as layers

    torch.manual_seed(0)
    model = workload.build(layers)
    optimizer, criterion = torch.optim.SGD(model.parameters(), lr=0.05), workload.criterion()
    times = defaultdict(float)
    if mode is not None:
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, criterion = _ours(model, optimizer, loader, mode, criterion, fast_noise)
    if backend:
        model.compile(backend=backend)
    private = instrument(optimizer, times)
    return model, optimizer, criterion, times, private


def profile_model(name: str, args) -> dict:
    workload = WORKLOADS[name]
    x, y = _batch(workload, args)  # the benchmark's batch (seed 1), its first --batch-size samples
    noise = FAST_NOISE_NAMES[args.fast_noise]
    settings = {"non-private": build(workload, None, x, y, False, args.compile)}
    settings.update({mode: build(workload, mode, x, y, noise, args.compile) for mode in args.modes})
    rows = {setting: defaultdict(list) for setting in settings}
    for step in range(args.warmup + args.steps):
        for setting, (model, optimizer, criterion, times, private) in settings.items():
            row = step_phases(model, optimizer, criterion, x, y, times, private, clock=CLOCKS[args.timer][0])
            if step >= args.warmup:
                for key, value in row.items():
                    rows[setting][key].append(value)
    return {setting: {k: statistics.median(v) for k, v in row.items()} for setting, row in rows.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="convnet,sequence,transformer,lstm,llama")
    parser.add_argument("--modes", nargs="+", default=["bk"])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the first samples of the benchmark batch (e.g. 2: the step's fixed cost)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fast-noise", choices=tuple(FAST_NOISE_NAMES), default="off")
    parser.add_argument("--compile", metavar="BACKEND", help="compile every model in place with this backend")
    parser.add_argument("--timer", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: process CPU time (one thread); wall: wall clock (several threads)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.models.split(","):
        results[name] = profile_model(name, args)
        batch = f" (its first {args.batch_size} samples)" if args.batch_size else ""
        batch += f", compiled by {args.compile}" if args.compile else ""
        print(f"\n{name}: {WORKLOADS[name].description}{batch}; noise {args.fast_noise}, {args.threads} thread(s), "
              f"median {CLOCKS[args.timer][1]} ms over {args.steps} steps\n")
        print(table(results[name], {mode: "non-private" for mode in args.modes}))
    return results


if __name__ == "__main__":
    main()

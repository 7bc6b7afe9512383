"""How many rows a block of the ``Linear`` ghost norm's Gram products should keep, on this machine.

The Gram products ``A_i A_iᵀ`` and ``G_i G_iᵀ`` are formed in row blocks (symmetry leaves
``(k + 1) / 2k`` of the work in ``k`` blocks) of at least ``MIN_BLOCK_ROWS`` rows
(:func:`opacus_dp.grad_sample.bookkeeping.norm_samplers.linear.row_blocks`). This script times the
norms of typical layers with each candidate floor side by side (interleaved, median of the
repetitions, ratio to the 128-row floor), and with ``--models`` one ``bk`` training step of the
benchmark models (``fast_noise="philox"``) with each floor, alternating on the same model (median
of the per-round ratios to the non-private step). With ``--device cuda`` the layers' norms are
timed on the GPU (wall clock, synchronised), against the floor used there
(``MIN_BLOCK_ROWS_ELSEWHERE``)::

    OMP_NUM_THREADS=1 python scripts/benchmark_row_blocks.py [--models sequence,llama]
    python scripts/benchmark_row_blocks.py --device cuda
"""

import argparse
import os
import statistics
import sys
from contextlib import contextmanager
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark_layers import CLOCKS, _timed  # noqa: E402

from opacus_dp.grad_sample.bookkeeping.norm_samplers import linear  # noqa: E402

FLOORS = (128, 64, 32)
SHAPES = ((32, 128, 256, 1024), (32, 128, 1024, 256), (16, 128, 256, 688), (16, 128, 768, 768),
          (8, 256, 768, 768), (4, 512, 256, 1024), (2, 1024, 768, 768))


@contextmanager
def block_rows(rows: int, device_type: str = "cpu"):
    """The floor of ``device_type`` (``linear.MIN_BLOCK_ROWS`` on CPU, else
    ``linear.MIN_BLOCK_ROWS_ELSEWHERE``) set to ``rows`` for the duration."""
    name = "MIN_BLOCK_ROWS" if device_type == "cpu" else "MIN_BLOCK_ROWS_ELSEWHERE"
    released = getattr(linear, name)
    setattr(linear, name, rows)
    try:
        yield
    finally:
        setattr(linear, name, released)


def _clock_ms(function, device: torch.device = torch.device("cpu")) -> float:
    """Process CPU time on CPU; wall clock between synchronisations on a GPU."""
    return _timed(function, device, CLOCKS["cpu" if device.type == "cpu" else "wall"]) * 1e3


def time_norms(shape, repeats: int, warmup: int, device: torch.device = torch.device("cpu")) -> Dict:
    """Median ms of the norms of one layer call ``(B, T, d, p)`` per floor, interleaved."""
    batch, positions, d, p = shape
    torch.manual_seed(0)
    a, g = torch.randn(batch, positions, d, device=device), torch.randn(batch, positions, p, device=device)
    times: Dict[int, List[float]] = {rows: [] for rows in FLOORS}
    for rep in range(warmup + repeats):
        for rows in FLOORS:
            with block_rows(rows, device.type):
                elapsed = _clock_ms(lambda: linear.gram_sq_norms(a, g), device)
            if rep >= warmup:
                times[rows].append(elapsed)
    blocks = {}
    for rows in FLOORS:
        with block_rows(rows, device.type):
            blocks[rows] = linear.row_blocks(positions, device.type)
    return {"shape": shape, "ms": {rows: statistics.median(t) for rows, t in times.items()}, "blocks": blocks}


def time_model_steps(name: str, repeats: int, warmup: int) -> Dict:
    """Per-round ratios of a ``bk`` step to the non-private step, for each floor, one model."""
    from benchmark import build_step
    from benchmark_models import WORKLOADS

    workload = WORKLOADS[name]
    torch.manual_seed(1)
    x, y = workload.batch()
    plain, private = build_step(workload, "non-private", x, y), build_step(workload, "bk", x, y, fast_noise="philox")
    ratios: Dict[int, List[float]] = {rows: [] for rows in FLOORS}
    for rep in range(warmup + repeats):
        base = _clock_ms(plain)
        for rows in FLOORS:
            with block_rows(rows):
                elapsed = _clock_ms(private)
            if rep >= warmup:
                ratios[rows].append(elapsed / base)
    return {"model": name, "ratio": {rows: statistics.median(r) for rows, r in ratios.items()}}


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default="", help="comma-separated benchmark models for the step A/B")
    parser.add_argument("--shapes", default="", help="B,T,d,p;... instead of the default layer shapes")
    parser.add_argument("--device", default="cpu", help="where the layers' norms are timed (cpu, cuda)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if args.models and device.type != "cpu":
        parser.error("--models times the CPU benchmark models: leave --device at cpu")
    shapes = [tuple(int(v) for v in item.split(",")) for item in args.shapes.split(";") if item] or SHAPES
    if any(len(shape) != 4 or min(shape) < 1 for shape in shapes):
        parser.error("--shapes: B,T,d,p with positive integers, separated by ';'")
    floor = linear.MIN_BLOCK_ROWS if device.type == "cpu" else linear.MIN_BLOCK_ROWS_ELSEWHERE
    clock = "CPU time" if device.type == "cpu" else f"wall clock on {device}"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock}, released floor "
          f"{floor} rows")
    print(f"{'B, T, d, p':22} " + " ".join(f"{f'{rows} rows ms (k)':>18}" for rows in FLOORS)
          + " " + " ".join(f"{f'x {rows}':>7}" for rows in FLOORS[1:]))
    layers = [time_norms(shape, args.repeats, args.warmup, device) for shape in shapes]
    for row in layers:
        cells = " ".join(f"{row['ms'][rows]:13.2f} ({row['blocks'][rows]})" for rows in FLOORS)
        ratios = " ".join(f"{row['ms'][rows] / row['ms'][FLOORS[0]]:7.3f}" for rows in FLOORS[1:])
        print(f"{str(row['shape']):22} {cells} {ratios}")
    models = [time_model_steps(name, args.repeats, args.warmup) for name in args.models.split(",") if name]
    if models:
        print(f"\n{'model':12} " + " ".join(f"{f'bk x np, {rows} rows':>18}" for rows in FLOORS))
        for row in models:
            print(f"{row['model']:12} " + " ".join(f"{row['ratio'][rows]:18.3f}" for rows in FLOORS))
    return {"layers": layers, "models": models}


if __name__ == "__main__":
    main()

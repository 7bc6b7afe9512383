"""What sharing input Gram products saves: ``Linear`` layers called on one tensor, in ``bk``.

Two blocks, each a group of ``Linear`` layers reading the same input (B, T, d): the q/k/v
projections of an attention block (three d → d) and the gate/up projections of a gated MLP
(two d → 4d). For each, one step's per-sample work as the ``bk`` mode does it (forward,
backward with the per-sample norms, flat clip factors, clipped sums; ``benchmark_layers.py``'s
``bk``) is timed as released (``shared``: the input's Gram products formed once) and with the
forward pass's counting of calls per input switched off (``unshared``: every call forms its
own), interleaved, median of each. ``taken`` is the products a step took from an earlier call;
``same`` whether both ways gave bit-identical norms and clipped sums.

    OMP_NUM_THREADS=1 python scripts/benchmark_shared_grams.py --clock cpu [--width 768]
"""

import argparse
import os
import statistics
import sys
from contextlib import contextmanager
from typing import Dict, List

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_layers import CLOCKS, _loss, _timed, clipped_sums  # noqa: E402

from opacus_dp.grad_sample.bookkeeping import shared_input_grams  # noqa: E402
from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule  # noqa: E402


class OneInput(nn.Module):
    """``n`` Linear layers ``d → p`` on the same input, their outputs concatenated."""

    def __init__(self, n: int, d: int, p: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, p, bias=False) for _ in range(n))

    def forward(self, x):
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


@contextmanager
def counting(shared: bool):
    """As released, or with no call counted (nothing kept, nothing taken)."""
    original = shared_input_grams.SharedInputGrams.expect
    if not shared:
        shared_input_grams.SharedInputGrams.expect = lambda self, inputs: None
    try:
        yield
    finally:
        shared_input_grams.SharedInputGrams.expect = original


def make_step(n: int, d: int, p: int, x: torch.Tensor, shared: bool):
    """``(model, step)``: a fresh block (seed 0) and a closure running one ``bk`` step of it,
    which returns the norms and clipped sums."""
    torch.manual_seed(0)
    block = OneInput(n, d, p).to(x.device)
    model = BookkeepingGradSampleModule(block, batch_first=True, loss_reduction="sum")

    def step():
        with counting(shared):
            model.zero_grad(set_to_none=True)
            _loss(model(x)).backward()
            params = [p for p in model.parameters() if p.requires_grad]
            return model.per_sample_norms(params), clipped_sums(model)

    return model, step


def run_block(name: str, n: int, d: int, p: int, args) -> Dict:
    torch.manual_seed(1)
    x = torch.randn(args.batch_size, args.positions, d, device=args.device)
    models, steps, results = {}, {}, {}
    for shared in (True, False):
        models[shared], steps[shared] = make_step(n, d, p, x, shared)
        results[shared] = steps[shared]()
    same = all(torch.equal(a, b) for part in (0, 1) for a, b in zip(results[True][part], results[False][part]))
    grams = {shared: models[shared]._bookkeeper._input_grams for shared in steps}
    before = {shared: grams[shared].taken for shared in steps}
    times: Dict[bool, List[float]] = {True: [], False: []}
    order = [True, False]
    for rep in range(args.warmup + args.repeats):
        order = order[::-1]
        for shared in order:
            elapsed = _timed(steps[shared], torch.device(args.device), CLOCKS[args.clock])
            if rep >= args.warmup:
                times[shared].append(elapsed)
    steps_run = args.warmup + args.repeats
    taken = {shared: (grams[shared].taken - before[shared]) / steps_run for shared in steps}
    medians = {shared: statistics.median(times[shared]) for shared in steps}
    for model in models.values():
        model.close()
    return {"block": name, "shape": f"B{args.batch_size} T{args.positions} {n}x {d}->{p}",
            "shared_ms": medians[True] * 1e3, "unshared_ms": medians[False] * 1e3,
            "ratio": medians[False] / medians[True], "taken": taken[True],
            "taken_unshared": taken[False], "same": same}


def main(argv=None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768, help="d, the input width")
    parser.add_argument("--positions", type=int, default=128, help="T, positions per sample")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if min(args.width, args.positions, args.batch_size, args.repeats) < 1 or args.warmup < 0:
        parser.error("--width, --positions, --batch-size and --repeats must be >= 1, --warmup >= 0")
    d = args.width
    rows = [run_block("q/k/v", 3, d, d, args), run_block("gate/up", 2, d, 4 * d, args)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"median of {args.repeats}")
    print(f"{'block':8} {'shape':28} {'shared ms':>10} {'unshared ms':>12} {'unshared/shared':>16} "
          f"{'taken':>6} {'same':>5}")
    for r in rows:
        print(f"{r['block']:8} {r['shape']:28} {r['shared_ms']:10.2f} {r['unshared_ms']:12.2f} "
              f"{r['ratio']:16.3f} {r['taken']:6.1f} {str(r['same']):>5}")
    return rows


if __name__ == "__main__":
    main()

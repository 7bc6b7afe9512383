"""The private step's per-parameter overhead, in same-size ``add_`` passes.

One ``Linear(d, d)`` without bias (``d = 4096``: 16.8 M parameters) and a batch of 2, where the
per-sample work is negligible: what a private step adds over the non-private step is work
proportional to the parameter count (noise, copies, casts, passes over the sums). Side by side in
one process, interleaved rounds, median of each:

* ``non-private``: zero_grad, forward, sum-of-squares loss, backward, SGD step;
* ``private <mode>``: the same through ``make_private(grad_sample_mode=<mode>)``, σ = 1, with the
  noise of ``--fast-noise`` (``off``: the default generator, ``threads``: ``fast_noise=True``,
  ``philox``: ``fast_noise="philox"``, drawn and added in one pass); with ``--api classic`` through
  ``PrivacyEngine(model, ...).attach(optimizer)`` instead, whose 0.x lifecycle shows no
  ``p.summed_grad`` after the step, so the noise goes into the clipped sum in place (``make_private``
  keeps the sum readable as ``p.summed_grad`` until ``zero_grad()``: one more tensor of the
  parameter's size is written, a new one each step);
* ``noise``: the draw of ``--fast-noise`` for the parameter's size: ``torch.normal`` (what the
  default noise draws), else the fast generator's noise added in place into a tensor of that size;
* ``add_``: one in-place addition of that size.

Printed: ``overhead = private − non-private``, ``overhead − noise``, and both in units of ``add_``.

    OMP_NUM_THREADS=1 python scripts/benchmark_step_overhead.py --repeats 15

``--timer cpu`` (default) times the process's CPU (all threads together: the work); ``--timer
wall`` the wall clock (what a step takes with the machine's threads, e.g. ``OMP_NUM_THREADS=2``).
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.engine.fast_noise import FAST_NOISE_NAMES


def build(mode, d: int, loss_reduction: str, fast_noise=False, api: str = "modern"):
    """A step function of the non-private (``mode=None``) or private model (``step.weight``: the
    weight it trains)."""
    torch.manual_seed(0)
    model = layer = nn.Linear(d, d, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, d), torch.randn(2, d)
    if mode is not None:
        from opacus_dp import PrivacyEngine

        privacy = dict(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, loss_reduction=loss_reduction,
                       fast_noise=fast_noise)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if api == "classic":
                PrivacyEngine(model, batch_size=2, sample_size=64, **privacy).attach(optimizer)
            else:
                model, optimizer, _ = PrivacyEngine().make_private(
                    module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=2),
                    **privacy)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).sum()
        (loss if loss_reduction == "sum" else loss / 2).backward()
        optimizer.step()
    step.weight = layer.weight
    return step


def noise_draw(fast_noise: str, d: int):
    """One step's noise of the ``--fast-noise`` setting for ``d × d`` coordinates (module doc)."""
    if fast_noise == "off":
        return lambda: torch.normal(0.0, 1.0, size=(d, d))
    from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
    from opacus_dp.optim.philox_noise import PhiloxGaussianNoise

    noise = (PhiloxGaussianNoise if fast_noise == "philox" else ParallelGaussianNoise)(seed=1)
    target = torch.zeros(d, d)

    def draw():
        noise.begin_step(target.device)
        noise.add_sample_(target, 1.0)
    return draw


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--modes", default="bk,hooks")
    parser.add_argument("--loss-reduction", choices=("mean", "sum"), default="mean")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--fast-noise", choices=tuple(FAST_NOISE_NAMES), default="off")
    parser.add_argument("--timer", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--api", choices=("modern", "classic"), default="modern")
    args = parser.parse_args(argv)
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    d = args.dim
    buffer = torch.empty(d * d)
    variants = {"non-private": build(None, d, args.loss_reduction),
                **{f"private {m}": build(m, d, args.loss_reduction, FAST_NOISE_NAMES[args.fast_noise], args.api) for m in args.modes.split(",")},
                "noise": noise_draw(args.fast_noise, d), "add_": lambda: buffer.add_(buffer)}
    samples = {name: [] for name in variants}
    for round_ in range(args.warmup + args.repeats):
        for name, fn in variants.items():
            start = clock()
            fn()
            if round_ >= args.warmup:
                samples[name].append(1000 * (clock() - start))
    ms = {name: statistics.median(values) for name, values in samples.items()}
    print(f"Linear({d}, {d}), batch 2, loss {args.loss_reduction}, noise {args.fast_noise}, {args.api} API; median "
          f"{'process CPU' if args.timer == 'cpu' else 'wall-clock'} ms of {args.repeats} rounds, "
          f"{torch.get_num_threads()} threads")
    for name, value in ms.items():
        print(f"  {name:14s} {value:8.1f} ms")
    result = {"ms": ms}
    add = max(ms["add_"], 1e-9)
    for m in args.modes.split(","):
        overhead = ms[f"private {m}"] - ms["non-private"]
        result[m] = {"overhead_ms": overhead, "overhead_add": overhead / add,
                     "without_noise_add": (overhead - ms["noise"]) / add}
        print(f"  {m}: overhead {overhead:.1f} ms = {overhead / add:.1f} add_; without the noise draw "
              f"{overhead - ms['noise']:.1f} ms = {(overhead - ms['noise']) / add:.1f} add_")
    return result


if __name__ == "__main__":
    main()

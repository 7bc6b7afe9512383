"""What a private step costs per hooked layer where the layers' own work is negligible.

A stack of ``--layers`` tiny ``Linear(--width, --width)`` layers (batch ``--batch-size``, sum-of-
squares loss, SGD): the arithmetic is a few hundred multiply-adds per layer, so what a private step
adds over the non-private one is the per-layer and per-parameter bookkeeping — the forward hooks
that record each call, the output-gradient hooks and per-sample norms in the backward pass, and in
``step()`` the clip factors, each layer's clipped sum, the checks and the noise of each parameter.
Side by side in one process, interleaved steps, each phase timed (process CPU time); printed per
mode: the median time of forward, backward and ``step()`` per layer, and the private minus the
non-private time per layer. On a GPU a step of a large model is short enough for this per-layer
cost to show; on CPU it is what a model of many small layers pays.

    OMP_NUM_THREADS=1 python scripts/benchmark_layer_overhead.py [--layers 64] [--modes bk,hooks]
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

PHASES = ("forward", "backward", "step")


def build(mode, layers: int, width: int, batch: int):
    """A step function of the model (``mode=None``: non-private) recording its phases' times."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    if mode is not None:
        from opacus_dp import PrivacyEngine

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, _ = PrivacyEngine().make_private(
                module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
                noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=False)
    times = {phase: [] for phase in PHASES}

    def step():
        optimizer.zero_grad()
        start = time.process_time()
        loss = ((model(x) - y) ** 2).sum()
        forward = time.process_time()
        loss.backward()
        backward = time.process_time()
        optimizer.step()
        done = time.process_time()
        for phase, (a, b) in zip(PHASES, ((start, forward), (forward, backward), (backward, done))):
            times[phase].append(b - a)

    step.times, step.model, step.optimizer = times, model, optimizer
    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--modes", default="bk,hooks")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    steps = {"non-private": build(None, args.layers, args.width, args.batch_size)}
    steps.update({mode: build(mode, args.layers, args.width, args.batch_size) for mode in args.modes.split(",")})
    for _ in range(args.warmup + args.steps):
        for step in steps.values():
            step()
    per_layer = {name: {phase: 1e6 * statistics.median(step.times[phase][args.warmup:]) / args.layers
                        for phase in PHASES} for name, step in steps.items()}
    print(f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch_size}: median process CPU "
          f"µs per layer over {args.steps} steps, {torch.get_num_threads()} thread(s)")
    print(f"{'':12s} " + " ".join(f"{phase:>9s}" for phase in PHASES) + f" {'total':>9s} {'above non-private':>18s}")
    base = sum(per_layer["non-private"].values())
    for name, row in per_layer.items():
        total = sum(row.values())
        above = "" if name == "non-private" else f"{total - base:18.1f}"
        print(f"{name:12s} " + " ".join(f"{row[phase]:9.1f}" for phase in PHASES) + f" {total:9.1f} {above}")
    return per_layer


if __name__ == "__main__":
    main()

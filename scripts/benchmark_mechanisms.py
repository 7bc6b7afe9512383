#!/usr/bin/env python
"""Utility of the noise mechanisms at the same (ε, δ): DP-SGD vs banded vs BLT.

Tasks: ``digits`` (scikit-learn's handwritten digits, the main job's data, a linear model with
momentum SGD as in ``examples/quickstart.py``) and ``convnet`` (a small CIFAR-like convnet on
synthetic 3×32×32 data drawn from 10 fixed class templates plus noise; no download). For every
mechanism and seed σ is calibrated by ``make_private_with_epsilon`` for the same ε, δ and epochs;
the script prints test accuracy (mean ± std over the seeds), σ, the predicted mean squared
error of the noise in the prefix sums of the gradients at that σ relative to DP-SGD's
(``σ²·Δ²‖A C⁻¹‖²_F/n``), time per step and the size of the noise buffers.

Usage: ``python scripts/benchmark_mechanisms.py --task digits --epochs 5 --epsilon 4 --seeds 3``
"""

import argparse
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.mechanisms.noise import CorrelatedNoise


def digits(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    features = images.astype(np.float32) / 16.0 - 0.5
    x_tr, x_te, y_tr, y_te = train_test_split(features, labels, test_size=0.2, random_state=0, stratify=labels)
    as_set = lambda x, y: TensorDataset(torch.from_numpy(x), torch.from_numpy(y))  # noqa: E731
    return as_set(x_tr, y_tr), as_set(x_te, y_te), lambda: nn.Linear(64, 10)


def convnet(seed: int, train_size: int = 2000, test_size: int = 500):
    gen = torch.Generator().manual_seed(1234)
    templates = torch.randn(10, 3, 32, 32, generator=gen)

    def draw(n, offset):
        g = torch.Generator().manual_seed(offset)
        y = torch.randint(0, 10, (n,), generator=g)
        return TensorDataset(templates[y] * 0.5 + torch.randn(n, 3, 32, 32, generator=g), y)

    def model():
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))

    return draw(train_size, 1), draw(test_size, 2), model


def run(args, mechanism: str, seed: int) -> dict:
    train_set, test_set, build = (digits if args.task == "digits" else convnet)(seed)
    torch.manual_seed(seed)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train_set, batch_size=args.batch_size, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="prv")
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=args.epsilon,
            target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
            noise_generator=torch.Generator().manual_seed(seed + 1), noise_mechanism=mechanism,
            bands=args.bands if mechanism == "banded" else None)
    criterion, steps, start = nn.CrossEntropyLoss(), 0, time.perf_counter()
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            steps += 1
    seconds = time.perf_counter() - start
    with torch.no_grad():
        x, y = test_set.tensors
        acc = float((model(x).argmax(1) == y).float().mean())
    noise = optimizer.noise
    buffers = sum(t.numel() * t.element_size() for step in noise.state_dict()["buffers"] for t in step) \
        if isinstance(noise, CorrelatedNoise) else 0
    mse = noise.strategy.mse if isinstance(noise, CorrelatedNoise) else (steps + 1) / 2
    return {"acc": acc, "error": optimizer.noise_multiplier ** 2 * mse, "sigma": optimizer.noise_multiplier, "eps": engine.get_epsilon(args.delta), "steps": steps,
            "ms_per_step": 1000 * seconds / max(steps, 1), "buffer_bytes": buffers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["digits", "convnet"], default="digits")
    parser.add_argument("--mechanisms", default="independent,banded,blt")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"# {args.task}: epochs={args.epochs} ε={args.epsilon} δ={args.delta} batch={args.batch_size} "
          f"bands={args.bands} lr={args.lr} momentum={args.momentum} seeds={args.seeds}")
    print("| mechanism | accuracy (mean ± std) | σ | ε spent | steps | prefix-sum MSE vs DP-SGD | ms/step | noise buffers |")
    print("|---|---|---|---|---|---|---|---|")
    baseline = None
    for mechanism in args.mechanisms.split(","):
        results = [run(args, mechanism, seed) for seed in range(args.seeds)]
        baseline = baseline or results[0]["error"]
        accs = [r["acc"] for r in results]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        r = results[0]
        print(f"| {mechanism} | {100 * statistics.mean(accs):.1f} ± {100 * spread:.1f} % | {r['sigma']:.3f} | "
              f"{max(x['eps'] for x in results):.3f} | {r['steps']} | {r['error'] / baseline:.3f} | "
              f"{statistics.mean(x['ms_per_step'] for x in results):.2f} | {r['buffer_bytes'] / 1024:.1f} KiB |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

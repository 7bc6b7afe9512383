#!/usr/bin/env python3
"""Quickstart: a differentially private classifier of handwritten digits in a few seconds.

Data: scikit-learn's ``load_digits`` (1,797 real 8×8 greyscale digits, shipped with
scikit-learn, no download), split once into 80 % train / 20 % test with a fixed seed.

Recipe (DP-SGD, Abadi et al. 2016, with the accountant's ε at δ):

* preprocessing that does not look at the private data: pixel values 0..16 are mapped to
  ``x/16 − 1/2`` with fixed constants (statistics of the training set would leak privacy
  unless they were themselves released privately);
* a linear softmax classifier (64 → 10) — few parameters, so the added noise
  ``N(0, σ²C²)`` per coordinate hurts little;
* large Poisson batches (``--batch-size 512`` makes 3 batches per pass, so q = 1/3), 60
  steps, σ calibrated by ``make_private_with_epsilon`` so that the whole run spends at most
  ``--target-epsilon`` (PRV accountant, Gopi et al. 2021);
* SGD with momentum and per-sample clipping bound C = 1.

Run ``python examples/quickstart.py`` (add ``--json out.json`` for a machine-readable summary).
"""

import argparse
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from common.cli import make_parser
from common.digits import accuracy, load_data
from common.notices import engine_notices
from common.reporting import run_and_report, settings_line
from opacus_dp import PrivacyEngine

SECURE_MODE_NOTE = "note: secure_mode is off (fine for experiments; use secure_mode=True for a released model)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private digit classifier (DP-SGD) on sklearn's digits")
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--target-epsilon", type=float, default=3.0, help="privacy budget ε")
    parser.add_argument("--delta", type=float, default=1e-5, help="privacy parameter δ")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation, sampling and noise")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--batch-size", type=int, default=512, help="expected (Poisson) batch size")
    parser.add_argument("--accountant", default="prv", choices=["prv", "rdp", "gdp"], help="privacy accountant")
    parser.add_argument("--json", metavar="PATH", help="write accuracy, ε and settings to this file")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be positive")
    return args


def make_engine(accountant: str) -> PrivacyEngine:
    """The privacy engine; its secure-mode reminder becomes one short line on stderr (Python
    would print the warning with a source line), other warnings are shown as usual."""
    with engine_notices(True, SECURE_MODE_NOTE):
        return PrivacyEngine(accountant=accountant)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    model = nn.Linear(train_set.tensors[0].shape[1], 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train_set, batch_size=args.batch_size,
                        generator=torch.Generator().manual_seed(args.seed))
    engine = make_engine(args.accountant)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=args.target_epsilon,
        target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
        noise_generator=torch.Generator().manual_seed(args.seed + 1))
    print(settings_line(sigma=optimizer.noise_multiplier, sample_rate=loader.sample_rate,
                        steps_per_epoch=len(loader), delta=args.delta, accountant=engine.accountant.mechanism(),
                        planned_steps=args.epochs * len(loader)), flush=True)
    criterion = nn.CrossEntropyLoss()
    for _ in range(args.epochs):
        model.train()
        for features, labels in loader:  # Poisson batches; an empty one is still a (noise-only) step
            optimizer.zero_grad()
            criterion(model(features), labels).backward()
            optimizer.step()
    return {
        "test_accuracy": accuracy(model, test_set),
        "epsilon": engine.get_epsilon(args.delta),
        "delta": args.delta,
        "noise_multiplier": optimizer.noise_multiplier,
        "sample_rate": loader.sample_rate,
        "steps": len(engine.accountant),
        "accountant": engine.accountant.mechanism(),
        "history": [list(record) for record in engine.accountant.history],
        "train_size": len(train_set),
        "test_size": len(test_set),
    }


def main(argv=None) -> int:
    return run_and_report(train, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

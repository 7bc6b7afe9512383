#!/usr/bin/env python3
"""User-level privacy on the digits: protect every writer's whole contribution, not one digit.

Data: scikit-learn's ``load_digits`` (shipped, no download; the split of ``examples/quickstart.py``),
its training examples assigned to ``--writers`` simulated writers by a fixed public rule with label
skew (``examples/common/writers.py``: each writer draws most of its digits from two classes).

The guarantee is (ε, δ)-DP per writer: adding or removing all of one writer's digits. Two ways to
get it, both with σ calibrated so that the run spends at most ``--target-epsilon`` per writer:

* ``--privacy-unit user`` (ULS, user-level sampling): each step samples writers with probability
  q, takes at most ``--max-examples-per-user`` k random digits of each, averages each writer's
  gradients, clips that average to C and adds the noise once (``make_private_with_epsilon(...,
  privacy_unit="user", user_ids=...)``); the accountant's ε is per writer;
* ``--privacy-unit example`` (ELS, example-level sampling): every writer keeps its first k digits
  (a public rule: k must bound every writer), ordinary DP-SGD samples digits with probability q,
  and the per-writer ε follows by group privacy over k examples; σ comes from
  ``opacus_dp.accountants.user_level_calibration.get_user_level_noise_multiplier``.

Both use the same q, epochs, linear model and SGD. ``docs/user_level.md`` compares them.
Run ``python examples/user_level.py --privacy-unit user`` (``--json out.json`` for a summary).
"""

import argparse
import sys

import torch
import torch.nn as nn

from common.cli import make_parser
from common.digits import accuracy, load_data
from common.notices import engine_notices
from common.reporting import run_and_report, settings_line
from common.writers import DEFAULT_WRITERS, assign_writers, cap_per_writer, describe_writers, subset
from opacus_dp import PrivacyEngine
from opacus_dp.accountants.user_level_calibration import get_user_level_noise_multiplier
from opacus_dp.data import DPDataLoader

SECURE_MODE_NOTE = "note: secure_mode is off (fine for experiments; use secure_mode=True for a released model)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Digit classifier with a per-writer (user-level) privacy guarantee")
    add = parser.add_argument
    add("--privacy-unit", choices=["user", "example"], default="user",
        help="user: user-level sampling (ULS); example: example-level sampling, per-writer ε by group privacy (ELS)")
    add("--max-examples-per-user", type=int, default=8, help="k: a writer's digits per step (ULS) or in all (ELS)")
    add("--unit-gradient", choices=["mean", "sum"], default="mean", help="ULS: a writer's gradient")
    add("--writers", type=int, default=DEFAULT_WRITERS, help="simulated writers")
    add("--target-epsilon", type=float, default=4.0, help="privacy budget ε per writer")
    add("--delta", type=float, default=1e-5, help="privacy parameter δ per writer")
    add("--sample-rate", type=float, default=0.5, help="q: probability of each writer (ULS) or digit (ELS) per step")
    add("--epochs", type=int, default=20, help="passes (about 1/q steps each)")
    add("--lr", type=float, default=1.0, help="learning rate")
    add("--momentum", type=float, default=0.0, help="SGD momentum")
    add("--max-grad-norm", type=float, default=1.0, help="clipping bound C (per writer for ULS)")
    add("--accountant", default="prv", choices=["prv", "rdp", "gdp"], help="privacy accountant")
    add("--seed", type=int, default=0, help="seed of initialisation, sampling and noise")
    add("--json", metavar="PATH", help="write accuracy, ε and settings to this file")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.max_examples_per_user < 1 or args.writers < 10:
        parser.error("--epochs and --max-examples-per-user must be positive, --writers at least 10")
    if not 0 < args.sample_rate <= 1:
        parser.error("--sample-rate must lie in (0, 1]")
    return args


def writer_data(args: argparse.Namespace):
    """``(train set, its writers, test set)``: every digit for ULS, the first k per writer for ELS."""
    train_set, test_set = load_data()
    writers = assign_writers(train_set.tensors[1], args.writers)
    if args.privacy_unit == "example":
        train_set, writers = subset(train_set, writers, cap_per_writer(writers, args.max_examples_per_user))
    return train_set, writers, test_set


def make_private(args, model, optimizer, loader, writers):
    """``(engine, model, optimizer, loader)`` with σ calibrated for the per-writer budget."""
    with engine_notices(True, SECURE_MODE_NOTE):
        engine = PrivacyEngine(accountant=args.accountant)
    common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=args.max_grad_norm,
                  noise_generator=torch.Generator().manual_seed(args.seed + 1))
    if args.privacy_unit == "user":
        made = engine.make_private_with_epsilon(
            target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs, privacy_unit="user",
            user_ids=writers, max_examples_per_user=args.max_examples_per_user, unit_gradient=args.unit_gradient,
            **common)
    else:
        sigma = get_user_level_noise_multiplier(
            target_epsilon=args.target_epsilon, target_delta=args.delta,
            max_examples_per_user=args.max_examples_per_user, sample_rate=loader.sample_rate, steps=args.epochs * len(loader), accountant=args.accountant)
        made = engine.make_private(noise_multiplier=sigma, **common)
    return (engine, *made)


def user_level_epsilon(engine: PrivacyEngine, args: argparse.Namespace) -> dict:
    """ε per writer so far; for ELS also the example-level (ε', δ') it comes from."""
    if args.privacy_unit == "user":
        return {"epsilon": engine.get_epsilon(args.delta)}
    epsilon = engine.get_epsilon(args.delta, privacy_unit="user", max_examples_per_user=args.max_examples_per_user)
    _, delta_example = engine.accountant.get_user_level_epsilon(args.delta, args.max_examples_per_user)
    return {"epsilon": epsilon, "example_epsilon": epsilon / args.max_examples_per_user,
            "example_delta": delta_example}


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    train_set, writers, test_set = writer_data(args)
    print(describe_writers(writers, train_set.tensors[1]), flush=True)
    model = nn.Linear(train_set.tensors[0].shape[1], 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DPDataLoader(train_set, sample_rate=args.sample_rate, generator=torch.Generator().manual_seed(args.seed))
    engine, model, optimizer, loader = make_private(args, model, optimizer, loader, writers)
    print(settings_line(sigma=optimizer.noise_multiplier, sample_rate=loader.sample_rate, steps_per_epoch=len(loader),
                        delta=args.delta, accountant=engine.accountant.mechanism(),
                        planned_steps=args.epochs * len(loader), unit=args.privacy_unit,
                        k=args.max_examples_per_user), flush=True)
    criterion = nn.CrossEntropyLoss()
    for _ in range(args.epochs):
        model.train()
        for features, labels in loader:  # an empty batch is still a (noise-only) step
            optimizer.zero_grad()
            criterion(model(features), labels).backward()
            optimizer.step()
    return {"test_accuracy": accuracy(model, test_set), **user_level_epsilon(engine, args), "delta": args.delta,
            "privacy_unit": args.privacy_unit, "max_examples_per_user": args.max_examples_per_user,
            "noise_multiplier": optimizer.noise_multiplier, "sample_rate": loader.sample_rate,
            "steps": len(engine.accountant), "accountant": engine.accountant.mechanism(),
            "history": [list(record) for record in engine.accountant.history], "train_size": len(train_set),
            "writers": int(writers.unique().numel()), "test_size": len(test_set)}


def main(argv=None) -> int:
    args = parse_args(argv)

    def group_privacy(result):
        if args.privacy_unit == "example":
            yield (f"by group privacy over k = {args.max_examples_per_user} digits from (ε', δ') = "
                   f"({result['example_epsilon']:.4f}, {result['example_delta']:.3g}) per digit")
    return run_and_report(train, args, " per writer", group_privacy)


if __name__ == "__main__":
    sys.exit(main())

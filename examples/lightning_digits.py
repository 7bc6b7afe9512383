#!/usr/bin/env python3
"""A differentially private digit classifier trained with PyTorch Lightning.

Data: scikit-learn's ``load_digits`` (1,797 real 8×8 digits, shipped with scikit-learn, no
download), split once into 80 % train / 20 % test with a fixed seed; pixels 0..16 mapped to
``x/16 − 1/2`` with fixed constants (statistics of the private data would leak privacy).

Privacy: ``opacus_dp.integrations.lightning``. ``train_dataloader()`` returns a
``PrivateDataLoader`` (Poisson batches of expected size ``--batch-size``) and ``DPCallback``
makes the model and optimizer private, with σ calibrated so that ``--epochs`` epochs spend at most
``--target-epsilon`` at ``--delta``; ε is logged as ``epsilon`` after every step.

Run ``python examples/lightning_digits.py`` (``--devices 2`` for two CPU processes with DDP;
``--json out.json`` for a machine-readable summary). Needs ``pip install lightning``.
"""

import argparse
import json
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common.cli import add_fast_noise_arg
from common.digits import accuracy, load_data
from opacus_dp.integrations.lightning import DPCallback, PrivateDataLoader

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Private digit classifier (DP-SGD) with PyTorch Lightning",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--target-epsilon", type=float, default=3.0, help="privacy budget ε")
    parser.add_argument("--delta", type=float, default=1e-5, help="privacy parameter δ")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound C")
    parser.add_argument("--batch-size", type=int, default=512, help="expected Poisson batch (all processes)")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (2 or more: Lightning's DDP)")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation, sampling and noise")
    add_fast_noise_arg(parser)
    parser.add_argument("--json", metavar="PATH", help="write accuracy, ε and σ to this file")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.devices < 1:
        parser.error("--epochs, --batch-size and --devices must be positive")
    return args


class DigitClassifier(pl.LightningModule):
    """A linear softmax classifier (64 → 10): few parameters, so the noise hurts little."""

    def __init__(self, train, test, batch_size: int, lr: float, momentum: float):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)
        self.train_set, self.test_set = train, test
        self.batch_size, self.lr, self.momentum = batch_size, lr, momentum

    def forward(self, x):
        return self.linear(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)  # the mean of the per-example losses

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        return PrivateDataLoader(DataLoader(self.train_set, batch_size=self.batch_size))


def main(argv=None) -> int:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    train, test = load_data()
    model = DigitClassifier(train, test, args.batch_size, args.lr, args.momentum)
    privacy = DPCallback(target_delta=args.delta, target_epsilon=args.target_epsilon, epochs=args.epochs,
                         max_grad_norm=args.max_grad_norm, fast_noise=args.fast_noise)
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto", callbacks=[privacy], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="secure_mode is off")
        warnings.filterwarnings("ignore", message=".*does not have many workers")
        trainer.fit(model)
    if trainer.global_rank != 0:
        return 0
    summary = {"test_accuracy": accuracy(model, test), "epsilon": privacy.get_epsilon(), "delta": args.delta,
               "noise_multiplier": float(privacy.optimizer.noise_multiplier), "steps": privacy.optimizer.steps_taken,
               "train_size": len(train)}
    print(f"test accuracy = {100 * summary['test_accuracy']:.2f} %, ε = {summary['epsilon']:.2f} "
          f"(δ = {args.delta:g}), σ = {summary['noise_multiplier']:.3f}, {summary['steps']} steps")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

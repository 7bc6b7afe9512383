"""Augmentation multiplicity on the digits at equal ε: test accuracy for K = 1 (plain DP-SGD on
augmented examples) and larger K (each sampled example augmented K times, the K gradients averaged
before clipping: De et al. 2022), over several seeds.

Every K uses the same sampling (q = 1/len(loader)), epochs, clipping bound and σ (calibrated once
for the target ε by the same accountant: augmentation multiplicity changes no privacy parameter),
so the ε of every row is the same. Augmentation: a random shift of the 8×8 image by up to one pixel
in each direction (zero padding), drawn afresh at every read; K = 0 is the baseline without
augmentation (one row per example, unshifted).

    python scripts/benchmark_augmult.py --multiplicities 0,1,4,8,16 --seeds 5 --epsilon 4
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common.digits import accuracy, load_data  # noqa: E402
from opacus_dp import PrivacyEngine  # noqa: E402
from opacus_dp.accountants.calibration import get_noise_multiplier  # noqa: E402


class Shifted(Dataset):
    """The 8×8 digits, each read shifted by (dy, dx) ∈ {-1, 0, 1}² (zero padding)."""

    def __init__(self, dataset, shift: bool = True):
        self.x, self.y = dataset.tensors
        self.shift = shift

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        image = F.pad(self.x[i].view(1, 8, 8), (1, 1, 1, 1))
        dy, dx = torch.randint(0, 3, (2,)).tolist() if self.shift else (1, 1)
        return image[:, dy:dy + 8, dx:dx + 8].reshape(64), self.y[i]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(256, 10))


def train_once(multiplicity: int, seed: int, args, sigma: float) -> float:
    """Test accuracy of one private run."""
    train, test = load_data()
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(Shifted(train, shift=multiplicity > 0), batch_size=args.batch_size),
        noise_multiplier=sigma, max_grad_norm=args.max_grad_norm, grad_sample_mode="bk",
        augmentation_multiplicity=max(multiplicity, 1))
    for _ in range(args.epochs):
        private.train()
        for x, y in loader:
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    args.epsilon_spent = engine.get_epsilon(args.delta)
    return accuracy(private, test)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multiplicities", default="0,1,4,8,16",
                        help="comma-separated K values (0: no augmentation)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=128, help="expected examples per step")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="also write the table (and the command) to this file")
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    train, _ = load_data()
    steps_per_epoch = -(-len(train) // args.batch_size)
    sample_rate = 1 / steps_per_epoch
    sigma = get_noise_multiplier(target_epsilon=args.epsilon, target_delta=args.delta, sample_rate=sample_rate,
                                 steps=args.epochs * steps_per_epoch, accountant="rdp")
    lines = [f"digits, ε = {args.epsilon} at δ = {args.delta} (RDP), σ = {sigma:.3f}, q = {sample_rate:.4f}, "
             f"{args.epochs} epochs, C = {args.max_grad_norm}, {args.seeds} seeds", "",
             "| K | test accuracy (mean ± std) | per seed | ε spent | seconds per run |", "|---|---|---|---|---|"]
    for k in [int(v) for v in args.multiplicities.split(",")]:
        started = time.perf_counter()
        scores = [train_once(k, seed, args, sigma) for seed in range(args.seeds)]
        seconds = (time.perf_counter() - started) / args.seeds
        spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
        lines.append(f"| {k} | {statistics.mean(scores):.3f} ± {spread:.3f} | "
                     f"{', '.join(f'{s:.3f}' for s in scores)} | {args.epsilon_spent:.2f} | {seconds:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        command = "python scripts/benchmark_augmult.py " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.out).write_text(f"{table}\n\nCommand: `{command}`\n")
    return table


if __name__ == "__main__":
    main()

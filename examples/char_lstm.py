#!/usr/bin/env python3
"""Private character-level name classification with a DPLSTM (which language is a name from?).

Data: a folder of ``<Language>.txt`` files with one name per line (the layout of the classic
names dataset of the PyTorch tutorials, e.g. ``data/names/Italian.txt``). The classes are the
file names; the examples are split once into train and test with ``--split-seed``.

Encoding without looking at the private data: names are folded to ASCII (accents dropped) and
mapped through a fixed alphabet (letters, `` .,;'-``; anything else is one "unknown" symbol),
then cut or left-padded to ``--max-seq-length`` symbols, so every example is a tensor of the
same shape (empty Poisson batches keep that shape too).

Model: embedding → :class:`opacus_dp.layers.DPLSTM` (an ``nn.LSTM`` drop-in whose per-sample
gradients DP-SGD can compute) → the last layer's final hidden state → linear classifier.

Examples::

    python examples/char_lstm.py --synthetic --epochs 1              # offline try-out, random names
    python examples/char_lstm.py --data-root data/names --epochs 50 --sigma 1.0 -c 1.5
    torchrun --nproc_per_node=2 examples/char_lstm.py --data-root data/names
"""

import argparse
import glob
import os
import string
import sys
import unicodedata
from typing import List, Tuple

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from common.classification import run_classification
from common.cli import (add_output_args, add_privacy_args, add_synthetic_args, add_training_args,
                        check_common_args, make_parser)
from common.data import missing_dataset
from common.distributed import init_from_args, shutdown

PAD, UNKNOWN = 0, 1
ALPHABET = string.ascii_letters + " .,;'-"
SYMBOL_INDEX = {c: i + 2 for i, c in enumerate(ALPHABET)}
VOCAB_SIZE = len(ALPHABET) + 2


def to_ascii(name: str) -> str:
    """Unicode name folded to ASCII: ``Šimůnek`` → ``Simunek``."""
    decomposed = unicodedata.normalize("NFKD", name)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def encode(name: str, length: int) -> torch.Tensor:
    """Symbol indices of ``name`` (its last ``length`` symbols), left-padded with PAD."""
    symbols = [SYMBOL_INDEX.get(c, UNKNOWN) for c in to_ascii(name)][-length:]
    return torch.tensor([PAD] * (length - len(symbols)) + symbols, dtype=torch.long)


def read_names(root: str) -> Tuple[List[str], List[Tuple[str, int]]]:
    """``(languages, [(name, class index)])`` from ``root/<Language>.txt``; exit code 2 if none."""
    files = sorted(glob.glob(os.path.join(root, "*.txt")))
    if not files:
        raise missing_dataset("names", [os.path.join(os.path.abspath(root), "<Language>.txt")],
                              "Pass --data-root, a folder with one <Language>.txt file per class "
                              "holding one name per line (e.g. the PyTorch tutorial's data/names).")
    languages = [os.path.splitext(os.path.basename(f))[0] for f in files]
    examples = []
    for index, path in enumerate(files):
        with open(path, encoding="utf-8") as f:
            examples += [(line.strip(), index) for line in f if line.strip()]
    return languages, examples


SYNTHETIC_LANGUAGES = 18  # the classes of the PyTorch tutorial's names data


def synthetic_names(size: int, length: int, seed: int):
    """``--synthetic``: ``size`` random names (3 to ``length`` symbols of the alphabet, left-padded)
    in SYNTHETIC_LANGUAGES classes, encoded like real ones."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min(3, length), length + 1, (size,), generator=generator)
    symbols = torch.randint(2, VOCAB_SIZE, (size, length), generator=generator)
    padding = torch.arange(length).unsqueeze(0) < (length - lengths).unsqueeze(1)
    return symbols.masked_fill(padding, PAD), torch.randint(SYNTHETIC_LANGUAGES, (size,), generator=generator)


def load_names(root: str, length: int, test_fraction: float, split_seed: int, synthetic_size: int = 0):
    """``(languages, train, test)`` tensor datasets of encoded names and class indices (random
    names when ``synthetic_size`` > 0)."""
    if synthetic_size:
        names, labels = synthetic_names(synthetic_size + synthetic_size // 4, length, split_seed)
        languages = [f"language{i}" for i in range(SYNTHETIC_LANGUAGES)]
        return (languages, TensorDataset(names[:synthetic_size], labels[:synthetic_size]),
                TensorDataset(names[synthetic_size:], labels[synthetic_size:]))
    languages, examples = read_names(root)
    names = torch.stack([encode(name, length) for name, _ in examples])
    labels = torch.tensor([label for _, label in examples], dtype=torch.long)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(split_seed))
    n_test = max(1, int(round(test_fraction * len(examples))))
    test, train = order[:n_test], order[n_test:]
    if len(train) == 0:
        raise SystemExit(f"--data-root {root}: only {len(examples)} names, none left for training")
    return languages, TensorDataset(names[train], labels[train]), TensorDataset(names[test], labels[test])


class CharLSTMClassifier(nn.Module):
    """Embedding → DPLSTM (batch first) → final hidden state of the last layer → linear."""

    def __init__(self, num_classes: int, embedding_size: int = 64, hidden_size: int = 128,
                 num_layers: int = 1):
        super().__init__()
        from opacus_dp.layers import DPLSTM

        self.embedding = nn.Embedding(VOCAB_SIZE, embedding_size)
        self.lstm = DPLSTM(embedding_size, hidden_size, num_layers=num_layers, batch_first=True)
        self.out = nn.Linear(hidden_size, num_classes)

    def forward(self, symbols: torch.Tensor) -> torch.Tensor:
        _, (h_n, _) = self.lstm(self.embedding(symbols))
        return self.out(h_n[-1])


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private name → language classifier (DPLSTM)")
    parser.add_argument("--data-root", default="data/names", help="folder of <Language>.txt files")
    add_synthetic_args(parser)
    parser.add_argument("--max-seq-length", type=int, default=15, help="symbols kept per name")
    parser.add_argument("--embedding-size", type=int, default=64, help="size of the symbol embeddings")
    parser.add_argument("--hidden-size", type=int, default=128, help="LSTM hidden size")
    parser.add_argument("--n-lstm-layers", type=int, default=1, help="LSTM layers")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="share of the names kept for testing")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split")
    add_training_args(parser, epochs=50, batch_size=800, lr=2.0, momentum=0.0)
    add_privacy_args(parser, sigma=1.0, max_grad_norm=1.5)
    add_output_args(parser, example="char_lstm")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    for name in ("max_seq_length", "embedding_size", "hidden_size", "n_lstm_layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.test_fraction < 1:
        parser.error("--test-fraction must lie in (0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    languages, train_set, test_set = load_names(args.data_root, args.max_seq_length, args.test_fraction,
                                                args.split_seed, args.synthetic_size if args.synthetic else 0)
    setup = init_from_args(args)
    if setup.is_main:
        print(f"{len(languages)} languages, {len(train_set)} training and {len(test_set)} test names")

    def build_model() -> nn.Module:
        return CharLSTMClassifier(len(languages), args.embedding_size, args.hidden_size, args.n_lstm_layers)

    try:
        return run_classification(args, build_model=build_model, train_set=train_set,
                                  test_set=test_set, setup=setup)
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())

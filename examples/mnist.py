#!/usr/bin/env python3
"""Private MNIST classifier (DP-SGD).

Model: the small convnet of the Opacus MNIST example (two strided convolutions with tanh and
max-pooling, a 32-unit dense layer, 10 outputs), with ``--width`` (16) channels in the first
convolution. Abadi et al. 2016 report about 97 % at ε ≈ 2 for DP-SGD on MNIST.

Data: ``torchvision.datasets.MNIST`` (``MNIST/raw/*-ubyte`` under ``--data-root``;
``--download`` fetches them). Pixels are mapped to [-1, 1] with fixed constants.

Examples::

    python examples/mnist.py --data-root ~/data --download --epochs 10 --sigma 1.0 -c 1.0
    python examples/mnist.py --api classic --target-epsilon 2 --epochs 10
    torchrun --nproc_per_node=2 examples/mnist.py --epochs 10
"""

import argparse
import os
import sys

import torch.nn as nn

from common.classification import run_classification
from common.cli import add_data_args, add_output_args, add_privacy_args, add_training_args, check_common_args
from common.data import missing_dataset
from common.distributed import init_distributed, shutdown

RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def sample_convnet(width: int = 16) -> nn.Module:
    """28×28 → conv8/2 (w) → pool → conv4/2 (2w) → pool → dense 32 → 10, tanh activations."""
    return nn.Sequential(
        nn.Conv2d(1, width, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(width, 2 * width, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(2 * width * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
    )


def load_mnist(root: str, download: bool):
    """``(train, test)`` MNIST datasets as tensors in [-1, 1]; exit code 2 if missing."""
    from torchvision import transforms
    from torchvision.datasets import MNIST

    raw = os.path.join(os.path.abspath(os.path.expanduser(root)), "MNIST", "raw")
    missing = [os.path.join(raw, name) for name in RAW_FILES if not os.path.isfile(os.path.join(raw, name))]
    if missing and not download:
        raise missing_dataset("MNIST", missing,
                              f"Get it with --download (into --data-root {root}), or place the "
                              f"uncompressed idx files in {raw}.")
    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    train = MNIST(root, train=True, transform=to_tensor, download=download)
    test = MNIST(root, train=False, transform=to_tensor)
    return train, test


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Private MNIST classifier (DP-SGD)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    add_training_args(parser, epochs=10, batch_size=240, lr=0.1, momentum=0.0)
    add_privacy_args(parser, sigma=1.0, max_grad_norm=1.0)
    add_output_args(parser, checkpoint_file="checkpoints/mnist.pt")
    add_data_args(parser, data_root="data/mnist")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.width < 1:
        parser.error("--width must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    train_set, test_set = load_mnist(args.data_root, args.download)
    setup = init_distributed(args.device)
    try:
        return run_classification(args, build_model=lambda: sample_convnet(args.width),
                                  train_set=train_set, test_set=test_set, setup=setup)
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())

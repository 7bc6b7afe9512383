#!/usr/bin/env python3
"""Private MNIST classifier (DP-SGD).

Model: the small convnet of the Opacus MNIST example (two strided convolutions with tanh and
max-pooling, a 32-unit dense layer, 10 outputs), with ``--width`` (16) channels in the first
convolution. Abadi et al. 2016 report about 97 % at ε ≈ 2 for DP-SGD on MNIST.

Data: ``torchvision.datasets.MNIST`` (``MNIST/raw/*-ubyte`` under ``--data-root``;
``--download`` fetches them). Pixels are mapped to [-1, 1] with fixed constants.

Examples::

    python examples/mnist.py --synthetic --epochs 1                  # offline try-out, random images
    python examples/mnist.py --data-root ~/data --download --epochs 10 --sigma 1.0 -c 1.0
    python examples/mnist.py --api classic --target-epsilon 2 --epochs 10
    torchrun --nproc_per_node=2 examples/mnist.py --epochs 10
"""

import argparse
import sys

import torch.nn as nn

from common import vision_data
from common.classification import run_classification
from common.cli import (add_data_args, add_output_args, add_privacy_args, add_training_args, check_common_args,
                        make_parser)
from common.distributed import init_from_args, shutdown


def sample_convnet(width: int = 16) -> nn.Module:
    """28×28 → conv8/2 (w) → pool → conv4/2 (2w) → pool → dense 32 → 10, tanh activations."""
    return nn.Sequential(
        nn.Conv2d(1, width, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(width, 2 * width, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(2 * width * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private MNIST classifier (DP-SGD)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    add_training_args(parser, epochs=10, batch_size=240, lr=0.1, momentum=0.0)
    add_privacy_args(parser, sigma=1.0, max_grad_norm=1.0)
    add_output_args(parser, example="mnist")
    add_data_args(parser, data_root="data/mnist")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.width < 1:
        parser.error("--width must be positive")
    return args


def datasets(args: argparse.Namespace):
    """``(train, test)``: the MNIST files, or ``--synthetic`` images of the same shape."""
    if args.synthetic:
        shape = dict(channels=1, side=28, num_classes=10, seed=args.seed)
        return (vision_data.synthetic_images(args.synthetic_size, train=True, **shape),
                vision_data.synthetic_images(args.synthetic_size, train=False, **shape))
    return (vision_data.mnist(args.data_root, download=args.download, train=True),
            vision_data.mnist(args.data_root, download=False, train=False))


def main(argv=None) -> int:
    args = parse_args(argv)
    train_set, test_set = datasets(args)
    setup = init_from_args(args)
    try:
        return run_classification(args, build_model=lambda: sample_convnet(args.width),
                                  train_set=train_set, test_set=test_set, setup=setup)
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())

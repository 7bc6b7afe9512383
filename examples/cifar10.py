#!/usr/bin/env python3
"""Private CIFAR-10 classifier (DP-SGD).

Models (``--architecture``):

* ``convnet`` (default): the tanh convnet of Papernot et al. 2020, "Tempered Sigmoid
  Activations for Deep Learning with Differential Privacy" — three blocks of two 3×3
  convolutions (w, 2w, 4w channels, w = ``--width`` = 32) with tanh and 2×2 max-pooling, a
  dense layer of 4w units with tanh, and the 10-way output;
* ``resnet``: a CIFAR ResNet (He et al. 2016, depth 6n+2 = ``--depth``) whose BatchNorm
  layers are GroupNorm (BatchNorm mixes the samples of a batch, which DP-SGD cannot allow).

Data: ``torchvision.datasets.CIFAR10`` files (``cifar-10-batches-py/`` under ``--data-root``;
``--download`` fetches them), see :func:`common.vision_data.cifar10`. Pixels are mapped to
[-1, 1] with fixed constants, no statistics of the private data.

Examples::

    python examples/cifar10.py --synthetic --epochs 1                # offline try-out, random images
    python examples/cifar10.py --data-root ~/data --download --epochs 20 --sigma 1.5 -c 1
    python examples/cifar10.py --api classic --batch-size 128 --n-accumulation-steps 8
    torchrun --nproc_per_node=2 examples/cifar10.py --epochs 20

Every flag of Opacus's own ``examples/cifar10.py`` is accepted with its meaning (``-j``,
``--wd``, ``-p``, ``-e`` = ``--evaluate``, ``-b`` = ``--batch-size-test``, ``--lr-schedule``,
``--clip_per_layer``, ``--log-dir``, ``--start-epoch``, ``--local_rank``, ``--dist_backend``,
``--grad_sample_mode``, ``--n_accumulation_steps``, ``--debug``).

Batch sizes, sample rate, resume and budgets: see ``examples/README.md``.
"""

import argparse
import math
import sys

import torch.nn as nn

from common import vision_data
from common.classification import run_classification
from common.cli import (add_data_args, add_output_args, add_privacy_args, add_training_args, check_common_args,
                        make_parser)
from common.distributed import init_from_args, shutdown

NUM_CLASSES = 10


# ------------------------------------------------------------------------------------ models
def tanh_convnet(width: int = 32, activation: str = "tanh", image_size: int = 32) -> nn.Module:
    """Papernot et al. 2020 convnet (see module doc); ``activation`` tanh or relu."""
    act = nn.Tanh if activation == "tanh" else nn.ReLU
    layers, channels = [], 3
    for out in (width, 2 * width, 4 * width):
        layers += [nn.Conv2d(channels, out, 3, padding=1), act(),
                   nn.Conv2d(out, out, 3, padding=1), act(), nn.MaxPool2d(2)]
        channels = out
    side = image_size // 8
    layers += [nn.Flatten(), nn.Linear(channels * side * side, 4 * width), act(),
               nn.Linear(4 * width, NUM_CLASSES)]
    return nn.Sequential(*layers)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(16, channels), channels)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with GroupNorm and an identity (or 1×1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(out_channels)
        self.act = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          group_norm(out_channels))

    def forward(self, x):
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.act(out + self.shortcut(x))


def resnet_groupnorm(depth: int = 20, width: int = 16) -> nn.Module:
    """CIFAR ResNet-``depth`` (3 stages of (depth−2)/6 blocks, widths w, 2w, 4w)."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"--depth must be 6n+2 with n ≥ 1 (8, 14, 20, ...), got {depth}")
    blocks = (depth - 2) // 6
    layers = [nn.Conv2d(3, width, 3, padding=1, bias=False), group_norm(width), nn.ReLU()]
    channels = width
    for stage, out in enumerate((width, 2 * width, 4 * width)):
        for b in range(blocks):
            layers.append(BasicBlock(channels, out, stride=2 if stage > 0 and b == 0 else 1))
            channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, NUM_CLASSES)]
    return nn.Sequential(*layers)


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.architecture == "resnet":
        return resnet_groupnorm(depth=args.depth, width=args.width or 16)
    return tanh_convnet(width=args.width or 32, activation=args.activation)


# ---------------------------------------------------------------------------------------- cli
def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private CIFAR-10 classifier (DP-SGD)")
    parser.add_argument("--architecture", default="convnet", choices=["convnet", "resnet"], help="model")
    parser.add_argument("--width", type=int, default=None,
                        help="base channels; None: 32 for convnet, 16 for resnet")
    parser.add_argument("--depth", type=int, default=20, help="ResNet depth 6n+2")
    parser.add_argument("--activation", default="tanh", choices=["tanh", "relu"], help="convnet activation")
    add_training_args(parser, epochs=20, batch_size=512, lr=1e-3, optim="RMSprop",
                      batch_size_test_flags=("-b", "--batch-size-test"))  # Opacus's short flag
    add_privacy_args(parser, sigma=1.5, max_grad_norm=1.2)
    add_output_args(parser, example="cifar10")
    add_data_args(parser, data_root="data/cifar10")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.width is not None and args.width < 1:
        parser.error("--width must be positive")
    return args


def datasets(args: argparse.Namespace):
    """``(train, test)``: the CIFAR-10 files, or ``--synthetic`` images of the same shape."""
    if args.synthetic:
        shape = dict(channels=3, side=32, num_classes=NUM_CLASSES, seed=args.seed)
        return (vision_data.synthetic_images(args.synthetic_size, train=True, **shape),
                vision_data.synthetic_images(args.synthetic_size, train=False, **shape))
    return (vision_data.cifar10(args.data_root, download=args.download, train=True),
            vision_data.cifar10(args.data_root, download=False, train=False))


def main(argv=None) -> int:
    args = parse_args(argv)
    train_set, test_set = datasets(args)
    setup = init_from_args(args)
    try:
        return run_classification(args, build_model=lambda: build_model(args), train_set=train_set,
                                  test_set=test_set, setup=setup)
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())

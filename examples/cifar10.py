#!/usr/bin/env python3
"""Private CIFAR-10 classifier (DP-SGD).

Models (``--arch``, alias ``--architecture``):

* ``convnet`` (default): the tanh convnet of Papernot et al. 2020, "Tempered Sigmoid
  Activations for Deep Learning with Differential Privacy" — three blocks of two 3×3
  convolutions (w, 2w, 4w channels, w = ``--width`` = 32) with tanh and 2×2 max-pooling, a
  dense layer of 4w units with tanh, and the 10-way output;
* ``resnet``: a CIFAR ResNet (He et al. 2016, depth 6n+2 = ``--depth``, default 20) whose
  BatchNorm layers are GroupNorm (BatchNorm mixes the samples of a batch, which DP-SGD cannot allow);
* ``wrn16_4``: the Wide ResNet of De et al. 2022 (arXiv:2204.13650) with GroupNorm and
  weight-standardised convolutions, WRN-16-4 unless ``--depth`` (6n+4) or ``--width`` says
  otherwise (:mod:`common.wide_resnet`).

The recipe of De et al. 2022 (``docs/training.md``, "Reproducing De et al. 2022"):

* ``--augmult K`` > 1 (augmentation multiplicity; default 1: no augmentation): every sampled
  training image is augmented K times independently (random crop after reflect padding 4, random
  horizontal flip), and the mean of its K gradients is clipped as one example and accounted as
  one (``make_private(..., augmentation_multiplicity=K)``, modern API; with ``--disable-dp`` each
  image is augmented once). A batch then has K rows per sampled example; with
  ``--n-accumulation-steps`` > 1 a physical batch holds at most ``--batch-size`` rows
  (``--batch-size``/K examples);
* ``--ema-decay D``: test accuracy (and the best checkpoint) from an exponential moving average
  of the parameters with warm-up, ``β_t = min(D, (1+t)/(10+t))`` (:mod:`common.ema`); the
  checkpoints then hold ``net.*`` (trained weights) and ``averages.*`` (the EMA).

Data: ``torchvision.datasets.CIFAR10`` files (``cifar-10-batches-py/`` under ``--data-root``;
``--download`` fetches them), see :func:`common.vision_data.cifar10`. Pixels are mapped to
[-1, 1] with fixed constants, no statistics of the private data.

Examples::

    python examples/cifar10.py --synthetic --epochs 1                # offline try-out, random images
    python examples/cifar10.py --data-root ~/data --download --epochs 20 --sigma 1.5 -c 1
    python examples/cifar10.py --api classic --batch-size 128 --n-accumulation-steps 8
    python examples/cifar10.py --arch wrn16_4 --augmult 16 --ema-decay 0.999 --sigma 3 -c 1 ...
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
from torch.utils.data import Dataset

from common import vision_data
from common.classification import run_classification
from common.cli import (add_data_args, add_output_args, add_privacy_args, add_training_args, check_common_args,
                        make_parser)
from common.distributed import init_from_args, shutdown
from common.ema import EMAModel, updated_after_steps
from common.wide_resnet import wide_resnet

NUM_CLASSES = 10
ARCHITECTURES = ("convnet", "resnet", "wrn16_4")


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
    """The ``--arch`` network, inside an :class:`~common.ema.EMAModel` when ``--ema-decay`` > 0."""
    if args.architecture == "wrn16_4":
        net = wide_resnet(depth=args.depth or 16, width=args.width or 4, num_classes=NUM_CLASSES)
    elif args.architecture == "resnet":
        net = resnet_groupnorm(depth=args.depth or 20, width=args.width or 16)
    else:
        net = tanh_convnet(width=args.width or 32, activation=args.activation)
    return EMAModel(net, args.ema_decay) if args.ema_decay > 0 else net


# ---------------------------------------------------------------------------------------- cli
def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private CIFAR-10 classifier (DP-SGD)")
    parser.add_argument("--architecture", "--arch", dest="architecture", default="convnet",
                        choices=ARCHITECTURES, help="model (module doc)")
    parser.add_argument("--width", type=int, default=None,
                        help="base channels (convnet: 32, resnet: 16), or the WRN widening factor (4)")
    parser.add_argument("--depth", type=int, default=None,
                        help="ResNet depth 6n+2 (default 20), or WRN depth 6n+4 (default 16)")
    parser.add_argument("--augmult", type=int, default=1, metavar="K",
                        help="augmentation multiplicity: K > 1 turns on crop+flip and averages the "
                             "gradients of K augmentations of each sampled example before clipping")
    parser.add_argument("--ema-decay", type=float, default=0.0, metavar="D",
                        help="evaluate an EMA of the parameters, decay min(D, (1+t)/(10+t)); 0: off")
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
    _check_recipe_args(parser, args)
    return args


def _check_recipe_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--depth`` of the chosen model, ``--augmult``, ``--ema-decay`` (argparse errors)."""
    base, name = (4, "WRN depth 6n+4 (10, 16, 22, ...)") if args.architecture == "wrn16_4" else \
        (2, "ResNet depth 6n+2 (8, 14, 20, ...)")
    if args.depth is not None and (args.depth < 6 + base or (args.depth - base) % 6):
        parser.error(f"--depth must be a {name}, got {args.depth}")
    if not 0.0 <= args.ema_decay < 1.0:
        parser.error(f"--ema-decay must lie in [0, 1), got {args.ema_decay}")
    if args.augmult < 1:
        parser.error(f"--augmult must be at least 1, got {args.augmult}")
    if args.augmult == 1 or args.disable_dp:
        return
    if args.api == "classic":
        parser.error("--augmult > 1 needs the modern API (make_private): drop --api classic")
    if args.n_accumulation_steps > 1 and args.batch_size < args.augmult:
        parser.error(f"--batch-size {args.batch_size} is the most rows of a physical batch; the "
                     f"{args.augmult} augmentations of an example must fit in one: pass at least --augmult")


def crop_flip(side: int = 32, padding: int = 4):
    """Random crop of ``side`` after reflect padding, then a horizontal flip with probability ½."""
    from torchvision import transforms

    return transforms.Compose([transforms.RandomCrop(side, padding=padding, padding_mode="reflect"),
                               transforms.RandomHorizontalFlip()])


class Augmented(Dataset):
    """``dataset`` (image tensors, label) with ``transform`` applied to every image read."""

    def __init__(self, dataset: Dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index]
        return self.transform(image), label


def datasets(args: argparse.Namespace):
    """``(train, test)``: the CIFAR-10 files, or ``--synthetic`` images of the same shape; the
    training images augmented by :func:`crop_flip` when ``--augmult`` > 1."""
    augment = args.augmult > 1
    if args.synthetic:
        shape = dict(channels=3, side=32, num_classes=NUM_CLASSES, seed=args.seed)
        train = vision_data.synthetic_images(args.synthetic_size, train=True, **shape)
        return (Augmented(train, crop_flip()) if augment else train,
                vision_data.synthetic_images(args.synthetic_size, train=False, **shape))
    transform = None
    if augment:
        from torchvision import transforms

        transform = transforms.Compose([crop_flip(), vision_data.to_unit_range(3)])
    return (vision_data.cifar10(args.data_root, download=args.download, train=True, transform=transform),
            vision_data.cifar10(args.data_root, download=False, train=False))


def main(argv=None) -> int:
    args = parse_args(argv)
    train_set, test_set = datasets(args)
    setup = init_from_args(args)
    try:
        with updated_after_steps() as track:  # --ema-decay: the EMA follows every optimizer step
            return run_classification(args, build_model=lambda: track(build_model(args)),
                                      train_set=train_set, test_set=test_set, setup=setup)
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())

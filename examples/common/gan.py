"""Pieces of the DCGAN example: networks, datasets, freezing D for G's step, image grids.

Networks follow Radford et al. 2016 (DCGAN) for square images of side ``2^k`` (k ≥ 3):
G maps z (nz×1×1) through a 4×4 transposed convolution and k−2 doublings to the image
(BatchNorm + ReLU, tanh output; G is not private, so BatchNorm is fine there). D mirrors it
with strided convolutions and LeakyReLU, and GroupNorm instead of BatchNorm (per-sample
normalisation, as DP-SGD requires), ending in one logit per image.
"""

import math
import os
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from common import vision_data


def _doublings(image_size: int) -> int:
    return int(math.log2(image_size)) - 2


class Generator(nn.Module):
    def __init__(self, nz: int, ngf: int, channels: int, image_size: int):
        super().__init__()
        k = _doublings(image_size)
        width = ngf * 2 ** (k - 1)
        layers = [nn.ConvTranspose2d(nz, width, 4, 1, 0, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)]
        for _ in range(k - 1):
            layers += [nn.ConvTranspose2d(width, width // 2, 4, 2, 1, bias=False),
                       nn.BatchNorm2d(width // 2), nn.ReLU(True)]
            width //= 2
        layers += [nn.ConvTranspose2d(width, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf: int, channels: int, image_size: int):
        super().__init__()
        k = _doublings(image_size)
        layers = [nn.Conv2d(channels, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2)]
        width = ndf
        for _ in range(k - 1):
            layers += [nn.Conv2d(width, 2 * width, 4, 2, 1, bias=False),
                       nn.GroupNorm(math.gcd(32, 2 * width), 2 * width), nn.LeakyReLU(0.2)]
            width *= 2
        layers += [nn.Conv2d(width, 1, 4, 1, 0, bias=False), nn.Flatten()]
        self.main = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.main(images).view(-1)


@contextmanager
def discriminator_frozen(discriminator: nn.Module):
    """D's parameters stop requiring gradients and its per-sample hooks pause (G's step)."""
    params = [p for p in discriminator.parameters() if p.requires_grad]
    pause = getattr(discriminator, "disable_hooks", None)
    if pause is not None:
        pause()
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
        if pause is not None:
            discriminator.enable_hooks()


def _digits(image_size: int, target_digit):
    """scikit-learn's 8×8 digits (values 0..16), resized to ``image_size``, in [-1, 1]."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.from_numpy(images.astype(np.float32) / 16.0).view(-1, 1, 8, 8)
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    y = torch.from_numpy(labels)
    if target_digit is not None:
        x, y = x[y == target_digit], y[y == target_digit]
    return TensorDataset(x * 2 - 1, y)


def build_dataset(args):
    """``(dataset, channels)`` for ``args.dataset`` (see the DCGAN example's doc)."""
    size = args.image_size
    channels = 1 if args.dataset in ("mnist", "digits") else 3
    if getattr(args, "synthetic", False):
        return vision_data.synthetic_images(args.synthetic_size, channels=channels, side=size, num_classes=10,
                                            seed=args.seed), channels
    if args.dataset == "digits":
        return _digits(size, args.target_digit), 1
    if args.dataset == "mnist":
        data = vision_data.mnist(args.data_root, download=args.download,
                                 transform=vision_data.to_unit_range(1, size))
        if args.target_digit is not None:
            data = Subset(data, torch.nonzero(data.targets == args.target_digit).view(-1).tolist())
        return data, 1
    if args.dataset == "cifar10":
        return vision_data.cifar10(args.data_root, download=args.download,
                                   transform=vision_data.to_unit_range(3, size)), 3
    if args.dataset == "folder":
        return vision_data.image_folder(args.data_root, transform=vision_data.to_unit_range(3, size)), 3
    from torchvision.datasets import FakeData

    return FakeData(size=args.fake_size, image_size=(3, size, size), num_classes=10,
                    transform=vision_data.to_unit_range(3)), 3


@torch.no_grad()
def save_grids(outf: str, dataset, generator: nn.Module, fixed_noise: torch.Tensor, epoch: int) -> None:
    """``real_samples.png`` (first 64 training images) and ``fake_samples_epoch_NNN.png``."""
    from torchvision.utils import save_image

    os.makedirs(outf, exist_ok=True)
    real_path = os.path.join(outf, "real_samples.png")
    if not os.path.exists(real_path):
        real = torch.stack([dataset[i][0] for i in range(min(64, len(dataset)))])
        save_image(real, real_path, normalize=True)
    was_training = generator.training
    generator.eval()
    fake = generator(fixed_noise)
    generator.train(was_training)
    save_image(fake, os.path.join(outf, f"fake_samples_epoch_{epoch:03d}.png"), normalize=True)

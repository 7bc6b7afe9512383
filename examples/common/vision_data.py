"""Image datasets of the examples, read with torchvision; a clear exit (code 2) when missing.

Pixels are mapped to [-1, 1] with fixed constants (``(x − 0.5) / 0.5``): no statistic of the
private data enters the preprocessing.
"""

import os
from typing import Callable, List, Optional

import torch
from torch.utils.data import TensorDataset

from common.data import download_errors, missing_dataset

MNIST_RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                   "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def to_unit_range(channels: int, resize: Optional[int] = None) -> Callable:
    """PIL image → tensor in [-1, 1] (optionally resized and centre-cropped to ``resize``)."""
    from torchvision import transforms

    steps: List = []
    if resize is not None:
        steps += [transforms.Resize(resize), transforms.CenterCrop(resize)]
    steps += [transforms.ToTensor(), transforms.Normalize((0.5,) * channels, (0.5,) * channels)]
    return transforms.Compose(steps)


def _absolute(root: str) -> str:
    return os.path.abspath(os.path.expanduser(root))


def cifar10(root: str, *, download: bool, train: bool = True, transform: Optional[Callable] = None):
    """torchvision's CIFAR-10 reader over ``root/cifar-10-batches-py``.

    The files must be present; their md5 sums are not compared, so a re-packed subset in the
    same format loads too (``--download`` verifies the md5 of the downloaded archive).
    """
    from torchvision.datasets import CIFAR10

    class CIFAR10Files(CIFAR10):
        train_list = [[name, None] for name, _ in CIFAR10.train_list]
        test_list = [[name, None] for name, _ in CIFAR10.test_list]
        meta = dict(CIFAR10.meta, md5=None)

    folder = os.path.join(_absolute(root), CIFAR10.base_folder)
    names = [name for name, _ in CIFAR10.train_list + CIFAR10.test_list] + [CIFAR10.meta["filename"]]
    missing = [os.path.join(folder, n) for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing and not download:
        raise missing_dataset("CIFAR-10", missing,
                              f"Get it with --download (into --data-root {root}), or unpack "
                              f"{CIFAR10.url} so that {folder} holds these files.")
    with download_errors("CIFAR-10", CIFAR10.url, enabled=download and bool(missing)):
        return CIFAR10Files(root, train=train, transform=transform or to_unit_range(3), download=download)


def mnist(root: str, *, download: bool, train: bool = True, transform: Optional[Callable] = None):
    """torchvision's MNIST over the uncompressed idx files in ``root/MNIST/raw``."""
    from torchvision.datasets import MNIST

    raw = os.path.join(_absolute(root), "MNIST", "raw")
    missing = [os.path.join(raw, n) for n in MNIST_RAW_FILES if not os.path.isfile(os.path.join(raw, n))]
    if missing and not download:
        raise missing_dataset("MNIST", missing,
                              f"Get it with --download (into --data-root {root}), or place the "
                              f"uncompressed idx files in {raw}.")
    with download_errors("MNIST", MNIST.mirrors[0], enabled=download and bool(missing)):
        return MNIST(root, train=train, transform=transform or to_unit_range(1), download=download)


def _has_entries(folder: str) -> bool:
    with os.scandir(folder) as entries:
        return any(entries)


def image_folder(root: str, *, transform: Callable):
    """``torchvision.datasets.ImageFolder`` (``root/<class>/<image>``)."""
    from torchvision.datasets import ImageFolder

    if not os.path.isdir(root) or not _has_entries(root):
        raise missing_dataset("image folder", [os.path.join(_absolute(root), "<class>", "<image>")],
                              "Pass --data-root, a folder with one sub-folder of images per class.")
    return ImageFolder(root, transform=transform)


def synthetic_images(size: int, *, channels: int, side: int, num_classes: int, seed: int,
                     train: bool = True) -> TensorDataset:
    """``--synthetic``: uniform pixels in [-1, 1] of shape ``(channels, side, side)`` and random
    labels; ``size`` training examples, or ``size // 4`` (at least 1) test examples."""
    generator = torch.Generator().manual_seed(seed * 2 + (0 if train else 1))
    n = size if train else max(1, size // 4)
    images = torch.rand(n, channels, side, side, generator=generator) * 2 - 1
    return TensorDataset(images, torch.randint(num_classes, (n,), generator=generator))

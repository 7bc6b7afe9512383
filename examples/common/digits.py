"""scikit-learn's handwritten digits (shipped with scikit-learn, no download): the fixed
train/test split of the digit examples and their accuracy."""

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

PIXEL_MAX = 16.0
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def load_data():
    """Fixed, stratified train/test split; pixels mapped to [-1/2, 1/2] with fixed constants."""
    images, labels = load_digits(return_X_y=True)
    features = images.astype(np.float32) / PIXEL_MAX - 0.5
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels)
    train = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    test = TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))
    return train, test


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """Share of ``dataset`` whose arg-max class is its label (``model`` left in eval mode)."""
    model.eval()
    features, labels = dataset.tensors
    return float((model(features).argmax(dim=1) == labels).float().mean())

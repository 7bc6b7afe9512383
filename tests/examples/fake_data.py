"""Tiny datasets written in the real on-disk formats the examples read.

* CIFAR-10: python pickles ``cifar-10-batches-py/data_batch_1..5``, ``test_batch``,
  ``batches.meta`` (dicts with ``data`` uint8 (n, 3072) and ``labels``);
* MNIST: uncompressed idx files ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``;
* an image folder (one sub-folder of PNGs per class, read by ``ImageFolder``);
* names: ``<Language>.txt`` files with one name per line.

Images carry a class-dependent pattern so that a few steps can learn something.
"""

import os
import pickle
import struct

import numpy as np

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _patterned_images(rng, labels, shape):
    """uint8 images: noise plus a bright band whose position encodes the label."""
    images = rng.integers(0, 80, size=(len(labels),) + shape, dtype=np.uint8)
    rows = shape[-2] if len(shape) == 3 else shape[0]
    for i, label in enumerate(labels):
        start = (int(label) * rows) // 10
        if len(shape) == 3:
            images[i, :, start:start + max(1, rows // 10), :] = 255
        else:
            images[i, start:start + max(1, rows // 10), :] = 255
    return images


def write_cifar10(root, *, per_batch=8, test_size=16, seed=0):
    """Write a CIFAR-10 copy with 5 × ``per_batch`` training and ``test_size`` test images."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = test_size if name == "test_batch" else per_batch
        labels = rng.integers(0, 10, size=n)
        images = _patterned_images(rng, labels, (3, 32, 32)).reshape(n, 3072)
        entry = {"batch_label": name, "labels": [int(x) for x in labels], "data": images,
                 "filenames": [f"{name}_{i}.png" for i in range(n)]}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(entry, f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    return root


def _write_idx_images(path, images):
    with open(path, "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(images), images.shape[1], images.shape[2]))
        f.write(images.astype(np.uint8).tobytes())


def _write_idx_labels(path, labels):
    with open(path, "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)))
        f.write(np.asarray(labels, dtype=np.uint8).tobytes())


def write_mnist(root, *, train_size=48, test_size=16, seed=0):
    """Write ``root/MNIST/raw`` idx files (uncompressed) as torchvision's MNIST reads them."""
    rng = np.random.default_rng(seed)
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, n in (("train", train_size), ("t10k", test_size)):
        labels = rng.integers(0, 10, size=n)
        _write_idx_images(os.path.join(raw, f"{prefix}-images-idx3-ubyte"),
                          _patterned_images(rng, labels, (28, 28)))
        _write_idx_labels(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels)
    return root


def write_image_folder(root, *, classes=2, per_class=6, size=16, seed=0):
    """Write ``root/<class>/<i>.png`` RGB images (ImageFolder layout)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = os.path.join(root, f"class_{c}")
        os.makedirs(folder, exist_ok=True)
        images = _patterned_images(rng, [c] * per_class, (3, size, size))
        for i, image in enumerate(images):
            Image.fromarray(image.transpose(1, 2, 0)).save(os.path.join(folder, f"{i}.png"))
    return root


NAMES = {
    "English": ["Smith", "Johnson", "Williams", "Brown", "Jones", "Miller", "Davis", "Wilson",
                "Taylor", "Clark", "Lewis", "Walker", "Hall", "Young", "Allen", "Wright"],
    "Italian": ["Rossi", "Russo", "Ferrari", "Esposito", "Bianchi", "Romano", "Colombo", "Ricci",
                "Marino", "Greco", "Bruno", "Gallo", "Conti", "Costa", "Giordano", "Mancini"],
    "Japanese": ["Sato", "Suzuki", "Takahashi", "Tanaka", "Watanabe", "Ito", "Yamamoto",
                 "Nakamura", "Kobayashi", "Kato", "Yoshida", "Yamada", "Sasaki", "Yamaguchi",
                 "Matsumoto", "Inoue"],
}


def write_names(root):
    """Write ``root/<Language>.txt`` files, one name per line (the names dataset layout)."""
    os.makedirs(root, exist_ok=True)
    for language, names in NAMES.items():
        with open(os.path.join(root, f"{language}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(names) + "\n")
    return root

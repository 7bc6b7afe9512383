"""The digits' training examples split into "writers" (users) by a fixed public rule.

scikit-learn's digits do not say who wrote each one, so users are simulated, reproducibly and
without looking at anything but the example's position ``i`` in the training split and its label
``y``: writer ``w`` (of ``W``, default 60) favours two classes, ``a = w mod 10`` and
``b = (a + 1 + ⌊w/10⌋ mod 9) mod 10`` (so ``b ≠ a``; with ``W = 60`` every class is favoured by
12 writers). Two hashes of ``i`` (BLAKE2b of ``"share:i"`` and ``"writer:i"``, as numbers in
[0, 1) and integers) place the example: with probability ``favourite_share`` (default 0.8) with
one of the writers favouring ``y``, otherwise with any writer, each chosen by the second hash.
Writers then hold about ``N/W`` examples each, most of them from their two classes, and their
sizes differ (label skew and size skew, as real writers).

Example-level training with a user-level guarantee by group privacy needs a hard bound ``k`` on
every writer's examples: :func:`cap_per_writer` keeps the first ``k`` of each writer (in index
order, a public rule) and drops the rest.
"""

import hashlib
from typing import List, Tuple

import torch
from torch.utils.data import TensorDataset

NUM_CLASSES = 10
DEFAULT_WRITERS = 60
FAVOURITE_SHARE = 0.8


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def favourite_classes(writer: int) -> Tuple[int, int]:
    """The two classes writer ``writer`` draws most of its examples from."""
    a = writer % NUM_CLASSES
    return a, (a + 1 + (writer // NUM_CLASSES) % (NUM_CLASSES - 1)) % NUM_CLASSES


def assign_writers(labels: torch.Tensor, num_writers: int = DEFAULT_WRITERS,
                   favourite_share: float = FAVOURITE_SHARE) -> torch.Tensor:
    """``(N,)`` long: the writer of every example (module doc), from positions and labels only."""
    if num_writers < NUM_CLASSES:
        raise ValueError(f"num_writers must be ≥ {NUM_CLASSES} (every class needs a writer who favours it), "
                         f"got {num_writers}")
    fans: List[List[int]] = [[] for _ in range(NUM_CLASSES)]
    for w in range(num_writers):
        for c in favourite_classes(w):
            fans[c].append(w)
    writers = []
    for i, y in enumerate(labels.tolist()):
        share = _hash(f"share:{i}") / 2.0 ** 64
        pick = _hash(f"writer:{i}")
        writers.append(fans[y][pick % len(fans[y])] if share < favourite_share else pick % num_writers)
    return torch.tensor(writers, dtype=torch.long)


def cap_per_writer(writers: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the examples kept when every writer keeps its first ``k`` (in index order)."""
    seen: dict = {}
    kept = []
    for i, w in enumerate(writers.tolist()):
        seen[w] = seen.get(w, 0) + 1
        if seen[w] <= k:
            kept.append(i)
    return torch.tensor(kept, dtype=torch.long)


def subset(dataset: TensorDataset, writers: torch.Tensor, indices: torch.Tensor):
    """``(dataset rows at indices, their writers)``."""
    return TensorDataset(*(t[indices] for t in dataset.tensors)), writers[indices]


def describe_writers(writers: torch.Tensor, labels: torch.Tensor) -> str:
    """One line: writers, examples per writer (min/median/max), share of each writer's examples in its two
    favourite classes (over all examples)."""
    sizes = torch.bincount(writers)
    sizes = sizes[sizes > 0]
    favoured = sum(int(y in favourite_classes(int(w))) for w, y in zip(writers.tolist(), labels.tolist()))
    return (f"writers: {len(sizes)}, examples per writer min/median/max = {int(sizes.min())}/"
            f"{int(sizes.median())}/{int(sizes.max())}, {100 * favoured / len(writers):.0f} % of the examples "
            "in their writer's two favourite classes")

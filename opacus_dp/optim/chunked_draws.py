"""Drawing one tensor of Gaussian noise in chunks, by a pool of threads.

A contiguous CPU tensor is cut into chunks of ``CHUNK_ELEMENTS`` consecutive coordinates (the
cut depends on its size only); chunk ``j`` is drawn from the generator of position
``(key, step, slot, j)`` (:mod:`~opacus_dp.optim.keyed_generators`), so the result is the same
for any number of threads and any order. torch releases the GIL while ``normal_`` fills a chunk,
and its CPU ``normal_`` runs on the calling thread, so the chunks are drawn side by side; the
sums and quotients inside a worker use NumPy, which also runs on the calling thread.
"""

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import torch

from opacus_dp.optim import keyed_generators as keyed

CHUNK_ELEMENTS = 1 << 18  # 1 MiB of float32 per chunk: cache-sized, 64 chunks for 16.8 M coordinates
SMALL_ELEMENTS = 1 << 16  # below this, a tensor is drawn on the calling thread from the step's small generator
_NUMPY_DTYPES = (torch.float32, torch.float64)
_pools: Dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the parent's threads


def thread_pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads (made once, kept for the next steps)."""
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="opacus_dp-noise")
        return _pools[workers]


def add_into(target: torch.Tensor, other: torch.Tensor) -> None:
    """``target += other`` on one thread (NumPy for float32/64 on CPU: inside a worker thread a
    torch operation would start a second team of OpenMP threads)."""
    if target.device.type == "cpu" and target.dtype in _NUMPY_DTYPES:
        array = target.detach().numpy()
        array += other.detach().numpy()
    else:
        target.add_(other)


def divide_into(target: torch.Tensor, divisor: float) -> None:
    """``target /= divisor`` on one thread (as :func:`add_into`)."""
    if target.device.type == "cpu" and target.dtype in _NUMPY_DTYPES:
        array = target.detach().numpy()
        array /= divisor
    else:
        target.div_(divisor)


def draw_noise(out: torch.Tensor, std: float, generator: torch.Generator, draws: int) -> None:
    """``out = z₁`` (``draws = 1``) or ``(z₁ + … + z_k) / √k`` (``k = draws``), each
    ``z ~ N(0, std²)`` drawn in turn from ``generator`` (the sum and quotient of
    :class:`~opacus_dp.optim.noise.GaussianNoise`'s secure mode)."""
    out.normal_(0.0, std, generator=generator)
    if draws > 1:
        extra = torch.empty_like(out)
        for _ in range(draws - 1):
            extra.normal_(0.0, std, generator=generator)
            add_into(out, extra)
        divide_into(out, math.sqrt(draws))


def draw_into(target: torch.Tensor, std: float, generator: torch.Generator, draws: int, add: bool) -> None:
    """``target = noise`` or, with ``add``, ``target += noise`` (the noise in a scratch buffer of
    the chunk's size: bitwise ``noise + target``)."""
    if not add:
        draw_noise(target, std, generator, draws)
        return
    noise = torch.empty_like(target)
    draw_noise(noise, std, generator, draws)
    add_into(target, noise)


def draw_chunks(flat: torch.Tensor, std: float, position, draws: int, add: bool, workers: int) -> None:
    """Chunk ``j`` of the contiguous 1-D CPU tensor ``flat`` (``CHUNK_ELEMENTS`` coordinates from
    ``j·CHUNK_ELEMENTS``) from the generator of ``(*position, j)``, by ``workers`` threads.
    ``position = (key, step, slot)``."""
    count = -(-flat.numel() // CHUNK_ELEMENTS)

    def chunk(j: int) -> None:
        part = flat[j * CHUNK_ELEMENTS:(j + 1) * CHUNK_ELEMENTS]
        draw_into(part, std, keyed.cpu_generator(*position, j), draws, add)

    if count == 1 or workers == 1:
        for j in range(count):
            chunk(j)
    else:
        keyed.state_template()  # the state layout is checked once, here, before the threads
        list(thread_pool(workers).map(chunk, range(count)))  # waits for every chunk, raises the first error

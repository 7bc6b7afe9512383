"""Drawing a tensor of Philox Gaussian noise: the stream of a position, cut in chunks for threads.

The stream of draw ``d`` of tensor ``slot`` at step ``t`` under a ``key`` is keyed by

    (k0, k1, c2, c3) = SHAKE-256("opacus_dp philox noise v1" ‖ key ‖ t ‖ slot ‖ d)   (FIPS 202),

four little-endian 32-bit words (key 16 bytes, the others 8): ``(k0, k1)`` is the Philox key and
``(c2, c3)`` the high half of every counter, so two positions share a stream only through a
collision of 128 bits of SHAKE-256. Element ``i`` of the tensor (flattened, row-major) is element
``i`` of its stream (``kernel.c``): the result is the same for any number of threads, chunk size
or build, and equal to :mod:`~opacus_dp.optim.philox.reference`'s, bit for bit.
"""

import hashlib
import math
import warnings
from typing import Optional

import numpy as np
import torch

from opacus_dp.optim.chunked_draws import thread_pool
from opacus_dp.optim.philox import native, openmp, reference
from opacus_dp.maths.huge_pages import empty_like_on_huge_pages
from opacus_dp.optim.philox.reference import TILE, Words

DOMAIN = b"opacus_dp philox noise v1\0"
CHUNK_ELEMENTS = 1 << 18  # the fewest elements of a kernel call (a multiple of TILE): the smallest unit of work
CHUNKS_PER_WORKER = 4  # a tensor is cut into about this many chunks per thread (each thread's start costs)
_warned = False


def stream_words(key: int, step: int, slot: int, draw: int) -> Words:
    """The key and counter words of a position (module doc)."""
    message = (DOMAIN + key.to_bytes(16, "little") + step.to_bytes(8, "little")
               + slot.to_bytes(8, "little") + draw.to_bytes(8, "little"))
    return tuple(int(w) for w in np.frombuffer(hashlib.shake_256(message).digest(16), dtype="<u4"))


def float32_value(x: float) -> float:
    """``x`` rounded to float32 (the factor both implementations multiply by)."""
    return float(np.float32(x))


def fill(out: torch.Tensor, base: Optional[torch.Tensor], words: Words, std: float, workers: int,
         divisor: float = 1.0) -> None:
    """``out = base + std·stream`` (``out = std·stream`` without ``base``; ``base`` may be ``out``),
    divided by ``divisor`` unless it is 1, 1-D contiguous float32 CPU tensors; by the native kernel
    in chunks on ``workers`` threads (torch's OpenMP threads where :mod:`.openmp` finds them, else
    a pool of our own), else by the torch reference (same numbers)."""
    kernel = native.kernel()
    if kernel is None:
        _warn_reference()
        reference.fill(out, base, 0, words, std, divisor)
        return
    n = out.numel()
    out_address = out.data_ptr()
    base_address = None if base is None else base.data_ptr()
    size = chunk_elements(n, workers)

    def chunk(start: int) -> None:
        count = min(size, n - start)
        kernel(out_address + 4 * start, None if base_address is None else base_address + 4 * start,
               start, count, *words, std, divisor)

    starts = range(0, n, size)
    team = openmp.gomp_parallel() if len(starts) > 1 and workers > 1 else None
    if team is not None:  # torch's OpenMP threads take the chunks in turn (openmp.py)
        reached = kernel.parallel(team, workers, size, out_address, base_address, 0, n, *words, std, divisor)
        if reached >= n:
            return
        if reached:  # cannot happen: a thread that ran took chunks until the counter passed n
            raise RuntimeError("the Philox noise's OpenMP team stopped part-way: this tensor's noise is incomplete")
        openmp.give_up()  # the team ran nothing, so nothing was written: the pool, from now on
    if len(starts) == 1 or workers == 1:
        for start in starts:
            chunk(start)
    else:
        list(thread_pool(workers).map(chunk, starts))  # waits for every chunk, raises the first error


def chunk_elements(n: int, workers: int) -> int:
    """The elements of one kernel call for a tensor of ``n`` on ``workers`` threads: about
    ``CHUNKS_PER_WORKER`` chunks per thread (a few, so that a thread held up elsewhere is made up
    for by the others), in tiles, at least ``CHUNK_ELEMENTS``. Any size gives the same numbers."""
    share = max(CHUNK_ELEMENTS, -(-n // (CHUNKS_PER_WORKER * max(1, workers))))
    return -(-share // TILE) * TILE  # whole tiles: a chunk starting inside a tile would repeat its draws


def refuse_wider_than_float32(dtype: torch.dtype, where: str) -> None:
    """Refuse a tensor more precise than float32: the stream's float32 draws added to a float64
    sum ``S`` leave ``released - S`` a float32 number, which no neighbouring sum matches (its
    low-order bits would identify ``S`` exactly, whatever σ)."""
    if dtype == torch.float64:
        raise TypeError(
            f"fast_noise='philox' draws float32 noise on CPU, but {where} is float64: float32 noise added to "
            "a float64 sum leaves the sum's low-order bits in the released value (the difference is exactly "
            "a float32 number for the true sum and for no neighbouring one), so the step would not be private. "
            "Use fast_noise=True or False (float64 draws) for float64 parameters, or train in float32")


def draw(target: torch.Tensor, std: float, position, draws: int, add: bool, workers: int) -> None:
    """``target = noise`` or, with ``add``, ``target += noise`` for a CPU tensor of float32 or
    less (:func:`refuse_wider_than_float32`); ``noise = Σ_{d<draws} std/√draws · z_d`` with
    ``z_d`` the stream of ``(*position, d)`` (``position = (key, step, slot)``; secure mode sums
    four draws, as the other noises do)."""
    refuse_wider_than_float32(target.dtype, "the noised tensor")
    scale = float32_value(std / math.sqrt(draws))
    direct = target.dtype == torch.float32 and target.is_contiguous()
    flat = target.view(-1) if direct else torch.empty(target.numel(), dtype=torch.float32)
    for d in range(draws):
        base = flat if (d > 0 or (add and direct)) else None
        fill(flat, base, stream_words(*position, d), scale, workers)
    if direct:
        return
    noise = flat.view(target.shape).to(target.dtype)
    if add:
        target.add_(noise)
    else:
        target.copy_(noise)


def noised(total: torch.Tensor, std: float, position, draws: int, workers: int, reuse: bool = False,
           divisor: float = 1.0) -> torch.Tensor:
    """``(total + noise) / divisor`` (:func:`draw`'s noise, bitwise ``total + noise`` then a
    division): a new tensor, or with ``reuse`` ``total`` itself; for a contiguous float32 ``total``
    in one pass per draw, the division in the last one."""
    if total.dtype != torch.float32 or not total.is_contiguous():
        out = total if reuse else total.clone(memory_format=torch.contiguous_format)
        draw(out, std, position, draws, add=True, workers=workers)
        return out if divisor == 1.0 else out.div_(divisor)
    out = total if reuse else empty_like_on_huge_pages(total)  # a new one written here first (huge_pages.py)
    flat, scale = out.view(-1), float32_value(std / math.sqrt(draws))
    for d in range(draws):
        fill(flat, total.view(-1) if d == 0 else flat, stream_words(*position, d), scale, workers,
             divisor if d == draws - 1 else 1.0)
    return out


def _warn_reference() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"the native Philox noise kernel is not available ({native.unavailable_reason()}): "
                      "the noise is computed by torch operations (the same numbers, about 20 times slower than "
                      "the default generator); install a C compiler (or set CC) to draw it at memory speed, or use "
                      "fast_noise=True or False", RuntimeWarning)

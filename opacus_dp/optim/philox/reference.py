"""The Philox Gaussian stream of ``kernel.c`` computed with torch operations, bit for bit.

What the noise falls back to where the native kernel cannot be built (:mod:`.native`), and the
oracle the kernel is tested against. The stream, the Philox4x32-10 rounds (Salmon et al., SC'11)
and the Box-Muller transform are described in ``kernel.c``; here every uint32 word is held in an
int64 tensor, and the 32 × 32-bit products are split in 16-bit halves so no int64 overflows:
``M·x = (M·x_hi)·2¹⁶ + M·x_lo``, ``hi = ⌊M·x_hi / 2¹⁶⌋ + ⌊mid / 2³²⌋``, ``lo = mid mod 2³²`` with
``mid = M·x_lo + (M·x_hi mod 2¹⁶)·2¹⁶``. The float operations are those of the kernel, in its order.
"""

from typing import Optional, Tuple

import torch

MASK32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10
LANES = 64
TILE = 4 * LANES  # elements per tile: four planes of LANES
CHUNK_TILES = 1024  # tiles computed at once (bounds the int64 temporaries)
# float32 constants of kernel.c (exact float32 values)
THIRD, FIFTH = float.fromhex("0x1.555556p-2"), float.fromhex("0x1.99999ap-3")
SEVENTH, NINTH = float.fromhex("0x1.24924ap-3"), float.fromhex("0x1.c71c72p-4")
LN2, HALF_PI = float.fromhex("0x1.62e43p-1"), float.fromhex("0x1.921fb6p+0")
RSQRT2 = float.fromhex("0x1.6a09e6p-1")
SIN = tuple(float.fromhex(h) for h in ("-0x1.555556p-3", "0x1.111112p-7", "-0x1.a01a02p-13", "0x1.71de3ap-19"))
COS = tuple(float.fromhex(h) for h in ("-0x1p-1", "0x1.555556p-5", "-0x1.6c16c2p-10", "0x1.a01a02p-16", "-0x1.27e4fcp-22"))

Words = Tuple[int, int, int, int]  # (k0, k1, c2, c3): the key and the counter's high words


def mulhilo(multiplier: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``multiplier · x`` (module doc)."""
    low_part, high_part = multiplier * (x & 0xFFFF), multiplier * (x >> 16)
    mid = low_part + ((high_part & 0xFFFF) << 16)
    return (high_part >> 16) + (mid >> 32), mid & MASK32


def philox4x32_10(x: Tuple[torch.Tensor, ...], k0: int, k1: int) -> Tuple[torch.Tensor, ...]:
    """The four output words of the counters ``x`` (four int64 tensors of uint32 values) under ``(k0, k1)``."""
    x0, x1, x2, x3 = x
    for _ in range(ROUNDS):
        hi0, lo0 = mulhilo(PHILOX_M[0], x0)
        hi1, lo1 = mulhilo(PHILOX_M[1], x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
    return x0, x1, x2, x3


def box_muller(radius_word: torch.Tensor, angle_word: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(r cos θ, r sin θ)`` of two uint32 words (``kernel.c``), float32."""
    u = ((radius_word >> 1).to(torch.float32) + 0.5) * 2.0 ** -31
    bits = u.view(torch.int32)
    mantissa = bits & 0x7FFFFF
    big = (mantissa > 0x3504F3).to(torch.int32)
    m = (mantissa | (0x3F800000 - (big << 23))).view(torch.float32)
    e = ((bits >> 23) - 127 + big).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = THIRD + s2 * (FIFTH + s2 * (SEVENTH + s2 * NINTH))
    ln_u = e * LN2 + (2.0 * s + (2.0 * s) * (s2 * p))
    radius = torch.sqrt((-2.0 * ln_u).double()).float()  # correctly rounded (float32 sqrt may not be)
    q = angle_word >> 30
    t = (((angle_word >> 6) & 0xFFFFFF).to(torch.float32) * 2.0 ** -24 - 0.5) * HALF_PI
    t2 = t * t
    st = t + (t * t2) * (SIN[0] + t2 * (SIN[1] + t2 * (SIN[2] + t2 * SIN[3])))
    ct = 1.0 + t2 * (COS[0] + t2 * (COS[1] + t2 * (COS[2] + t2 * (COS[3] + t2 * COS[4]))))
    c45, s45 = (ct - st) * RSQRT2, (ct + st) * RSQRT2
    odd = (q & 1).bool()
    cosine, sine = torch.where(odd, s45, c45), torch.where(odd, c45, s45)
    cosine = torch.where(((q ^ (q >> 1)) & 1).bool(), -cosine, cosine)
    sine = torch.where((q >> 1).bool(), -sine, sine)
    return radius * cosine, radius * sine


def normal_tiles(first_tile: int, tiles: int, words: Words, std: float) -> torch.Tensor:
    """Elements ``[first_tile·TILE, (first_tile + tiles)·TILE)`` of the stream times ``std``
    (``std`` a float32 value), float32 on CPU."""
    k0, k1, c2, c3 = words
    blocks = torch.arange(first_tile * LANES, (first_tile + tiles) * LANES, dtype=torch.int64)
    counters = (blocks & MASK32, blocks >> 32, torch.full_like(blocks, c2), torch.full_like(blocks, c3))
    w0, w1, w2, w3 = philox4x32_10(counters, k0, k1)
    planes = box_muller(w0, w1) + box_muller(w2, w3)
    return torch.stack([plane.view(tiles, LANES) for plane in planes], dim=1).reshape(-1) * std


def fill(out: torch.Tensor, base: Optional[torch.Tensor], start: int, words: Words, std: float,
         divisor: float = 1.0) -> None:
    """``out = base + stream[start:start + n]·std`` (or without ``base``), divided by ``divisor``
    unless it is 1; ``out`` and ``base`` 1-D contiguous float32 CPU tensors of ``n`` elements,
    ``start`` a multiple of ``TILE``."""
    if start % TILE:
        raise ValueError(f"start must be a multiple of {TILE}, got {start}")
    n, done = out.numel(), 0
    while done < n:
        tiles = min(CHUNK_TILES, -(-(n - done) // TILE))
        noise = normal_tiles((start + done) // TILE, tiles, words, std)[:n - done]
        part = out[done:done + noise.numel()]
        if base is None:
            part.copy_(noise)
        else:
            torch.add(base[done:done + noise.numel()], noise, out=part)
        if divisor != 1.0:
            part.div_(divisor)
        done += noise.numel()

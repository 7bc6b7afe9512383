"""Generators derived from a key and a position: the random sources of parallel noise.

Every draw of :class:`~opacus_dp.optim.parallel_noise.ParallelGaussianNoise` comes from a
generator made for its position ``(t, slot, lane)`` (step, tensor of the step, chunk of the
tensor) under the stream's ``key``. Nothing is shared between positions, so chunks can be drawn
by any thread in any order and the result depends on the key alone.

* CPU (MT19937): torch's ``manual_seed`` keeps only the low 32 bits of a seed, so seeds derived
  for millions of positions would collide (birthday bound ``n² / 2³³``). Instead the whole
  state of the Mersenne Twister, its 624 words of 32 bits, is

      words = SHAKE-256("opacus_dp parallel noise v1" ‖ key ‖ t ‖ slot ‖ lane)   (FIPS 202),

  each field little-endian of fixed width (key 16 bytes, the others 8), so distinct positions
  are distinct inputs, and two positions share a state only through a collision of SHAKE-256
  (probability about ``n² / 2²⁵⁷``). The words are written into torch's serialised generator
  state; :func:`check_state_layout` verifies once per process that writing the words of
  ``manual_seed(s)`` reproduces torch's own generator.
* CUDA and other devices: torch's generator there is counter-based Philox with a 64-bit seed.
  The seed of position ``n = t·2²⁴ + slot`` is the ``n``-th output of SplitMix64 (Steele, Lea &
  Flood 2014, "Fast splittable pseudorandom number generators") started from a 64-bit value of
  the key: ``n ↦ base + (n+1)·γ`` and the output mix are bijections of 64-bit words, so within
  one stream no two positions share a seed (``t < 2⁴⁰``, ``slot < 2²⁴``).
"""

import hashlib
import secrets
from typing import Optional

import numpy as np
import torch

_DOMAIN = b"opacus_dp parallel noise v1\0"
MT_WORDS = 624
_HEADER_BYTES = 24  # initial seed (8), left (4), seeded (4), next (8), then the 624 words as 8 bytes each
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: an odd constant, the golden ratio · 2⁶⁴
_SLOT_BITS = 24
_checked_template: Optional[torch.Tensor] = None


def mt_state_words(key: int, step: int, slot: int, lane: int) -> np.ndarray:
    """The 624 MT19937 words of position ``(step, slot, lane)`` under ``key`` (module doc)."""
    message = (_DOMAIN + key.to_bytes(16, "little") + step.to_bytes(8, "little")
               + slot.to_bytes(8, "little") + lane.to_bytes(8, "little"))
    return np.frombuffer(hashlib.shake_256(message).digest(4 * MT_WORDS), dtype="<u4")


def cpu_generator(key: int, step: int, slot: int, lane: int) -> torch.Generator:
    """A CPU generator whose whole MT19937 state is :func:`mt_state_words` of the position."""
    return generator_with_words(mt_state_words(key, step, slot, lane))


def generator_with_words(words: np.ndarray, template: Optional[torch.Tensor] = None) -> torch.Generator:
    """A CPU generator in the MT19937 state ``words`` (624 values below 2³²), about to twist;
    ``template``: a serialised state to write them into (default: the checked one)."""
    state = (template if template is not None else state_template()).clone()
    state.numpy()[_HEADER_BYTES:_HEADER_BYTES + 8 * MT_WORDS].view("<u8")[:] = words
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def os_seeded_generator(device="cpu") -> torch.Generator:
    """A generator on ``device`` whose whole state comes from the operating system's CSPRNG
    (:mod:`secrets`): on CPU all 624 words (19 968 bits) of the Mersenne Twister — ``manual_seed``
    would keep only 32 bits of any seed, few enough to search —, elsewhere (counter-based Philox)
    a 64-bit seed. What secure mode draws its noise and its Poisson samples from."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.Generator(device=device).manual_seed(secrets.randbits(64))
    state = state_template().clone()
    state.numpy()[:8].view("<u8")[0] = secrets.randbits(63)  # initial_seed(): the loaders' worker seeds
    return generator_with_words(np.frombuffer(secrets.token_bytes(4 * MT_WORDS), dtype="<u4"), state)


def splitmix64(base: int, index: int) -> int:
    """The ``index``-th output (from 0) of SplitMix64 started at ``base``."""
    z = (base + (index + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def device_generator(key: int, step: int, slot: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` (not CPU) seeded for position ``(step, slot)`` (module doc)."""
    if slot >> _SLOT_BITS or step >> (64 - _SLOT_BITS):
        raise ValueError(f"noise position (step={step}, slot={slot}) is beyond the device seeds' range "
                         f"(step < 2^{64 - _SLOT_BITS}, slot < 2^{_SLOT_BITS})")
    base = int.from_bytes(hashlib.shake_256(_DOMAIN + b"device" + key.to_bytes(16, "little")).digest(8), "little")
    return torch.Generator(device=device).manual_seed(splitmix64(base, (step << _SLOT_BITS) | slot))


def mt_seeding_words(seed: int) -> np.ndarray:
    """The words MT19937's ``init_genrand(seed)`` writes (Matsumoto & Nishimura 1998)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, MT_WORDS):
        previous = words[-1]
        words.append((1812433253 * (previous ^ (previous >> 30)) + i) & 0xFFFFFFFF)
    return np.array(words, dtype="<u4")


def check_state_layout() -> torch.Tensor:
    """torch's serialised CPU generator state, checked to hold the 624 MT19937 words where
    :func:`generator_with_words` writes them: a generator built from the words of
    ``manual_seed(s)`` must draw what torch's own does. Returns a fresh state (the template)."""
    global _checked_template
    seed = 20240229
    template = torch.Generator().manual_seed(seed).get_state()
    words = mt_seeding_words(seed)
    placed = template.numel() >= _HEADER_BYTES + 8 * MT_WORDS and np.array_equal(
        template.numpy()[_HEADER_BYTES:_HEADER_BYTES + 8 * MT_WORDS].view("<u8"), words)
    expected = torch.rand(64, generator=torch.Generator().manual_seed(seed))
    if not (placed and torch.equal(torch.rand(64, generator=generator_with_words(words, template)), expected)):
        raise RuntimeError(f"torch {torch.__version__} stores its CPU generator state in a layout the parallel "
                           "noise does not know: use the default noise (fast_noise=False)")
    _checked_template = template
    return template


def state_template() -> torch.Tensor:
    """The checked serialised CPU generator state (:func:`check_state_layout`, once per process)."""
    return _checked_template if _checked_template is not None else check_state_layout()

"""Gaussian noise drawn by several threads: an opt-in :class:`ParallelGaussianNoise`.

The default :class:`~opacus_dp.optim.noise.GaussianNoise` draws every coordinate from one
generator, serially. Here the draws of step ``t`` (``t`` counts the steps that drew noise) for
the ``slot``-th tensor of the step are cut into chunks of ``CHUNK_ELEMENTS`` consecutive
coordinates; chunk ``j`` is drawn from its own generator made for position ``(t, slot, j)`` under
the stream's key (:mod:`~opacus_dp.optim.keyed_generators`), by a pool of ``num_threads``
threads (torch releases the GIL while it fills a tensor). Chunk boundaries depend on the tensor's
size only, so the draws are the same for any number of threads and any scheduling.

* Tensors under ``SMALL_ELEMENTS`` coordinates are drawn, in call order, from one generator per
  step, made for the position of the step's first small tensor (a generator per bias vector
  would cost more than its draws).
* CUDA and other devices: one torch generator per tensor (counter-based Philox, parallel on the
  device), seeded for ``(t, slot)``.
* Each coordinate is ``N(0, std²)``; in secure mode the sum of four ``N(0, std²)`` draws halved
  (Holohan & Braun 2021, as :class:`~opacus_dp.optim.noise.GaussianNoise`), and the key is 128
  bits from the operating system's CSPRNG (:mod:`secrets`) at every step, never a user's seed.
  As for the default noise, torch's generators themselves are not cryptographic.

The noise is a different stream than :class:`GaussianNoise`'s (same distribution, other draws):
a run seeded alike draws other noise with this mechanism than without it.
"""

import hashlib
import secrets
import warnings
from typing import Optional

import torch

from opacus_dp.optim import keyed_generators as keyed
from opacus_dp.optim.chunked_draws import CHUNK_ELEMENTS, SMALL_ELEMENTS, draw_chunks, draw_into
from opacus_dp.optim.noise import SECURE_NUM_DRAWS, noise_kind_of_state, sampled_plus, seed_from_global_rng

SMALL_LANE = (1 << 64) - 1  # the lane of the step's small-tensor generator (chunks use lanes 0, 1, ...)
KEY_BITS, SECURE_KEY_BITS = 64, 128


def check_num_threads(num_threads: Optional[int]) -> Optional[int]:
    """``num_threads`` if None (torch's count at each draw) or an int ≥ 1."""
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be None (torch.get_num_threads()) or an int >= 1, got {num_threads!r}")
    return num_threads


def check_key(seed) -> int:
    """``seed`` as a stream key: an int in ``[0, 2⁶⁴)``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << KEY_BITS:
        raise ValueError(f"seed must be an int in [0, 2**{KEY_BITS}), got {seed!r}")
    return seed


def key_of_generator(generator: torch.Generator) -> int:
    """A 64-bit key derived from ``generator``'s current state (SHA-256; the generator is not advanced)."""
    state = bytes(generator.get_state().tolist())
    return int.from_bytes(hashlib.sha256(b"opacus_dp parallel noise key\0" + state).digest()[:8], "little")


class ParallelGaussianNoise:
    """Draws ``N(0, std²)`` tensors by chunks in parallel threads (module doc).

    A :class:`~opacus_dp.optim.noise_mechanism.NoiseMechanism`, like
    :class:`~opacus_dp.optim.noise.GaussianNoise`; its state is the key and the position
    ``(step, slot)`` of the next draw, so a resumed run draws what the uninterrupted one would.

    Args:
        generator: the key is derived from this generator's current state (not advanced).
        secure_mode: a 128-bit key from the operating system at every step (no seed accepted).
        seed: the 64-bit key itself. Without ``generator`` and ``seed`` the key is drawn from
            (not written to) torch's global RNG, so ``torch.manual_seed`` makes runs repeatable.
        num_threads: threads per tensor (default: ``torch.get_num_threads()`` at each draw).
    """

    shards_alike = True  # no state across steps: each rank may noise its shard with its own stream

    def __init__(self, generator: Optional[torch.Generator] = None, secure_mode: bool = False, *,
                 seed: Optional[int] = None, num_threads: Optional[int] = None):
        if secure_mode and (generator is not None or seed is not None):
            raise ValueError("generator and seed must be None when secure_mode=True: secure noise is keyed "
                             "from the operating system at every step and cannot be seeded by the user")
        if generator is not None and seed is not None:
            raise ValueError("pass generator or seed, not both (each one sets the key)")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self._secure = bool(secure_mode)
        self.num_threads = check_num_threads(num_threads)
        self.generator: Optional[torch.Generator] = None  # no single generator draws the noise
        self._key: Optional[int] = None
        if not self._secure:
            self._key = check_key(seed) if seed is not None else (
                key_of_generator(generator) if generator is not None else seed_from_global_rng())
        self._step, self._slot = 0, 0
        self._small: Optional[torch.Generator] = None  # the step's generator of small tensors

    @property
    def secure_mode(self) -> bool:
        return self._secure

    def generator_for(self, device: torch.device) -> torch.Generator:
        """A generator on ``device`` for the next draw's position (informative: the draws make
        their own generators, nothing is kept)."""
        device = torch.device(device)
        if device.type == "cpu":
            return keyed.cpu_generator(self._current_key(), self._step, self._slot, 0)
        return keyed.device_generator(self._current_key(), self._step, self._slot, device)

    def stream_base(self) -> bytes:
        """The key (8 bytes), from which a rank's stream is derived. Not in secure mode."""
        if self._secure:
            raise ValueError("a secure noise stream has no base: every step is keyed from the operating system")
        return self._key.to_bytes(8, "little")

    def reseed(self, seed: int) -> None:
        """Continue with the key ``seed`` (an int in ``[0, 2⁶⁴)``). Not in secure mode."""
        if self._secure:
            raise ValueError("a secure noise stream cannot be seeded")
        self._key, self._small = check_key(int(seed)), None

    def begin_step(self, device: torch.device) -> None:
        """Move to the next step if the current one drew anything; in secure mode, a new key."""
        if self._slot:
            self._step, self._slot = self._step + 1, 0
        self._small = None
        if self._secure:
            self._key = secrets.randbits(SECURE_KEY_BITS)

    def discard_step(self) -> None:
        """Nothing to forget (the draws' position is restored by :meth:`restore`)."""

    def check_schedule(self) -> None:
        """Nothing to check: independent draws do not depend on the step index."""

    def snapshot(self):
        """The position (and key, except in secure mode) before a step's draws."""
        small = None if self._small is None or self._secure else self._small.get_state()
        return (None if self._secure else self._key), self._step, self._slot, small

    def restore(self, snapshot) -> None:
        """Undo the draws of a refused step: back to :meth:`snapshot` (in secure mode the next
        draws take a new key from the operating system)."""
        key, self._step, self._slot, small = snapshot
        self._key = None if self._secure else key
        self._small = None
        if small is not None:
            self._small = torch.Generator()
            self._small.set_state(small)

    def sample(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """A new tensor like ``reference`` with i.i.d. ``N(0, std²)`` entries (zeros if std = 0)."""
        if std == 0:
            return torch.zeros_like(reference)
        out = torch.empty(reference.shape, dtype=reference.dtype, device=reference.device)
        self._draw(out, std, add=False)
        return out

    def add_sample_(self, total: torch.Tensor, std: float) -> torch.Tensor:
        """``total += N(0, std²)`` in place, chunk by chunk while the chunk is in cache; bitwise
        ``sample(total, std) + total`` (the same draws). Returns ``total``."""
        if std == 0:
            return total
        if total.device.type != "cpu" or not total.is_contiguous() or total.numel() < SMALL_ELEMENTS:
            return total.add_(self.sample(total, std))
        self._draw(total, std, add=True)
        return total

    def noised(self, total: torch.Tensor, std: float, reuse: bool = False) -> torch.Tensor:
        """A new tensor ``total + N(0, std²)`` (:meth:`sample`'s draw plus ``total``); with
        ``reuse``, added into ``total`` (:meth:`add_sample_`: the same numbers)."""
        return self.add_sample_(total, std) if reuse else sampled_plus(self.sample(total, std), total, False)

    def _draw(self, target: torch.Tensor, std: float, add: bool) -> None:
        key, step, slot = self._current_key(), self._step, self._slot
        self._slot += 1
        draws = SECURE_NUM_DRAWS if self._secure else 1
        if target.device.type != "cpu":
            draw_into(target, std, keyed.device_generator(key, step, slot, target.device), draws, add)
        elif target.numel() < SMALL_ELEMENTS:
            if self._small is None:
                self._small = keyed.cpu_generator(key, step, slot, SMALL_LANE)
            draw_into(target, std, self._small, draws, add)
        else:
            workers = self.num_threads or torch.get_num_threads()
            draw_chunks(target.view(-1), std, (key, step, slot), draws, add, workers)

    def _current_key(self) -> int:
        if self._key is None:  # secure mode, before the first step
            self._key = secrets.randbits(SECURE_KEY_BITS)
        return self._key

    @staticmethod
    def _saved_in_secure_mode(state: dict) -> bool:
        """True (with a warning: this run keeps its own key) for a state saved in secure mode."""
        if state.get("secure_mode"):
            warnings.warn("the noise state was saved in secure mode (no state): this run keeps its own noise "
                          "key, so it does not reproduce the saved run", UserWarning)
        return bool(state.get("secure_mode"))

    def state_dict(self) -> dict:
        """The key and the position of the next draw (nothing in secure mode)."""
        if self._secure:
            return {"secure_mode": True, "parallel_noise": {}}
        return {"secure_mode": False, "parallel_noise": {
            "key": self._key, "step": self._step, "slot": self._slot,
            "chunk_elements": CHUNK_ELEMENTS, "small_elements": SMALL_ELEMENTS}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (nothing in secure mode). The state of the default noise
        (another stream) is refused; a state saved in secure mode keeps this run's key, with a warning."""
        if self._secure or self._saved_in_secure_mode(state):
            return
        saved = state.get("parallel_noise")
        if saved is None:
            raise ValueError(f"the noise state was saved with {noise_kind_of_state(state)}, this optimizer draws "
                             "parallel noise (fast_noise=True): resume with the saved run's setting")
        layout = (saved["chunk_elements"], saved["small_elements"])
        if layout != (CHUNK_ELEMENTS, SMALL_ELEMENTS):
            raise ValueError(f"the noise state was saved with chunks of {layout} (chunk, small) elements, this "
                             f"version draws {(CHUNK_ELEMENTS, SMALL_ELEMENTS)}: its draws cannot be continued")
        self._key, self._step, self._slot = check_key(saved["key"]), int(saved["step"]), int(saved["slot"])
        self._small = None

"""Gaussian noise for DP-SGD: the std formula and the random sources.

The Gaussian mechanism adds ``N(0, (σ·Δ)²)`` independently to every coordinate of the
summed clipped gradient, where ``Δ`` is the L2 sensitivity reported by the clipper.
:func:`noise_std` is the single place where this std is computed.

Two sources of randomness:

* default: a ``torch.Generator`` owned by the optimizer/engine. Seed it (or pass your own)
  for reproducible runs. It never re-seeds the global torch RNG; when no generator is given
  its seed is drawn once from the global RNG, so ``torch.manual_seed`` makes runs repeatable.
* ``secure_mode=True``: every step a fresh generator takes its whole state from the operating
  system's CSPRNG (:mod:`secrets`; on CPU all 624 words of the Mersenne Twister, since torch's
  ``manual_seed`` keeps only 32 bits of a seed: :func:`~opacus_dp.optim.keyed_generators.os_seeded_generator`), and each coordinate is the sum of four
  independent Gaussians of std ``s`` divided by two (std ``s`` again), following Holohan &
  Braun 2021, "Secure Random Sampling in Differential Privacy". Cost: four draws instead of
  one per coordinate and one OS call per step. Caveats: floating-point Gaussian samplers
  leave gaps in the set of representable outputs that can reveal the unnoised value
  (Mironov 2012, "On Significance of the Least Significant Bits for Differential Privacy");
  summing several draws makes this attack much harder but is a mitigation, not a proof, and
  torch's generators themselves are not cryptographic between two OS reseeds.
"""

import math
import warnings
from typing import Optional, Tuple

import torch

from opacus_dp.accountants import validation
from opacus_dp.optim.keyed_generators import os_seeded_generator
from opacus_dp.optim.clipping import Clipper

SECURE_NUM_DRAWS = 4  # sum of 4 N(0, s²) divided by 2 is N(0, s²)


def noise_std(noise_multiplier: float, clipper: Clipper) -> float:
    """``σ · clipper.sensitivity`` (0 when σ = 0, even for an unbounded clipper), where ``σ`` is
    the clipper's share of the step's noise multiplier (all of it except for adaptive clipping,
    whose released count takes a part: :mod:`~opacus_dp.optim.adaptive_clipping`)."""
    check_noise_multiplier(noise_multiplier)
    noise_multiplier = clipper.gradient_noise_multiplier(noise_multiplier)
    if noise_multiplier == 0:
        return 0.0
    sensitivity = clipper.sensitivity
    if math.isinf(sensitivity):
        raise ValueError(
            "max_grad_norm is infinite, so noise_multiplier > 0 would add infinite noise: "
            "use a finite max_grad_norm (or noise_multiplier=0 for non-private training)"
        )
    return float(noise_multiplier) * sensitivity


def check_noise_multiplier(noise_multiplier) -> float:
    """``noise_multiplier`` as float if a finite real number ≥ 0 (NumPy scalars included), else
    ValueError/TypeError (the accountants' check, so both accept the same values)."""
    return validation.check_noise_multiplier(noise_multiplier)


def seed_from_global_rng() -> int:
    """A 62-bit seed drawn from (not written to) torch's global RNG."""
    return int(torch.randint(0, 2**62, (1,)).item())


def noise_kind_of_state(state: dict) -> str:
    """The ``fast_noise`` setting whose noise saved ``state`` (for refusals of another one)."""
    if "philox_noise" in state:
        return "fast_noise='philox'"
    if "parallel_noise" in state:
        return "fast_noise=True"
    return "fast_noise=False"


def sampled_plus(noise: torch.Tensor, total: torch.Tensor, reuse: bool) -> torch.Tensor:
    """``total + noise``: into ``noise`` (a new tensor), or with ``reuse`` into ``total`` (the same
    numbers: one addition per coordinate either way)."""
    return total.add_(noise) if reuse else noise.add_(total)


class GaussianNoise:
    """Draws ``N(0, std²)`` tensors from an owned generator, or securely (see module doc).

    A :class:`~opacus_dp.optim.noise_mechanism.NoiseMechanism`; ``shards_alike``: the draws keep
    no state across steps, so each rank may noise its own shard with its own stream."""

    shards_alike = True

    def __init__(self, generator: Optional[torch.Generator] = None, secure_mode: bool = False):
        if secure_mode and generator is not None:
            raise ValueError(
                "generator must be None when secure_mode=True: secure noise is seeded from "
                "the operating system and cannot be seeded by the user"
            )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.secure_mode = bool(secure_mode)
        self.generator = generator
        self._seed = None if (generator is not None or secure_mode) else seed_from_global_rng()

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The generator, created on ``device`` (seeded as documented) if there is none yet."""
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self._seed)
        return self.generator

    def stream_base(self) -> bytes:
        """What identifies this stream: the generator's state, else the seed it will be made with."""
        if self.generator is not None:
            return bytes(self.generator.get_state().tolist())
        return int(self._seed).to_bytes(8, "little")

    def reseed(self, seed: int) -> None:
        """Continue from a generator seeded with ``seed`` (a new one on the same device; the
        generator given by the user is not changed). Not in secure mode."""
        if self.secure_mode:
            raise ValueError("a secure noise stream cannot be seeded")
        if self.generator is None:
            self._seed = int(seed)
        else:
            self.generator = torch.Generator(device=self.generator.device).manual_seed(int(seed))

    def begin_step(self, device: torch.device) -> None:
        """In secure mode, reseed a fresh generator from the OS for the coming step."""
        if self.secure_mode:
            self.generator = os_seeded_generator(device)

    def discard_step(self) -> None:
        """Nothing to forget for independent noise (a refused step's generator state is
        restored by its caller; correlated noise also drops its uncommitted buffers)."""

    def snapshot(self) -> Tuple[Optional[torch.Generator], Optional[torch.Tensor]]:
        """The generator and its state before a step's draws (restored if the step is refused)."""
        generator = self.generator
        return generator, None if generator is None else generator.get_state()

    def restore(self, snapshot) -> None:
        """Undo the draws of a refused step: back to :meth:`snapshot`."""
        self.discard_step()
        self.generator, state = snapshot
        if state is not None:
            self.generator.set_state(state)

    def check_schedule(self) -> None:
        """Nothing to check: independent draws do not depend on the step index."""

    def sample(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """A tensor like ``reference`` with i.i.d. ``N(0, std²)`` entries (zeros if std=0)."""
        if std == 0:
            return torch.zeros_like(reference)
        gen = self.generator_for(reference.device)

        def draw() -> torch.Tensor:
            return torch.normal(0.0, std, size=reference.shape, generator=gen,
                                dtype=reference.dtype, device=gen.device)

        total = draw()
        if self.secure_mode:
            for _ in range(SECURE_NUM_DRAWS - 1):
                total += draw()
            total /= math.sqrt(SECURE_NUM_DRAWS)
        return total.to(reference.device)

    def noised(self, total: torch.Tensor, std: float, reuse: bool = False) -> torch.Tensor:
        """``total + N(0, std²)`` (:func:`sampled_plus`)."""
        return sampled_plus(self.sample(total, std), total, reuse)

    def state_dict(self) -> dict:
        """Generator state for checkpoints (nothing to save in secure mode)."""
        if self.secure_mode:
            return {"secure_mode": True}
        gen = self.generator_for(torch.device("cpu"))
        return {"secure_mode": False, "device": str(gen.device), "state": gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the generator saved by :meth:`state_dict`. In secure mode nothing is restored
        (every step reseeds from the OS); a state saved in secure mode holds no generator, so a
        run that is not secure keeps its own seed (with a warning: not reproducible)."""
        if self.secure_mode:
            return
        if state.get("secure_mode"):
            warnings.warn("the noise generator state was saved in secure mode (no state): this run "
                          "keeps its own noise seed, so it does not reproduce the saved run", UserWarning)
            return
        if "state" not in state:
            raise ValueError(f"the noise state was saved with {noise_kind_of_state(state)}, this optimizer draws "
                             "the default noise (fast_noise=False): resume with the saved run's setting")
        device = torch.device(state["device"])
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
        self.generator.set_state(state["state"])

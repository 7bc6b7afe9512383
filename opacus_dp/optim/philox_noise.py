"""Counter-based Gaussian noise at memory speed: :class:`PhiloxGaussianNoise` (``fast_noise="philox"``).

Every coordinate of every step is a pure function of the stream's key and its position
``(step, tensor of the step, coordinate)``: Philox4x32-10 (Salmon et al., SC'11) and Box-Muller,
computed by a native kernel that draws and adds in one pass over memory, on several threads
(:mod:`~opacus_dp.optim.philox`). Without a C compiler the same numbers come from torch
operations, about 20 times slower than the default noise (a warning says so). CUDA and other devices draw from torch's own generator
there (also counter-based Philox), seeded per ``(step, tensor)`` as
:class:`~opacus_dp.optim.parallel_noise.ParallelGaussianNoise`'s.

* Each coordinate is ``N(0, std²)`` up to float32 rounding (the radius is bounded by
  ``√(2·32·ln 2) ≈ 6.66``, the 32-bit resolution of the uniform: every draw is within 6.66·std);
  half-precision tensors get float32 draws converted; float64 tensors get
  :class:`~opacus_dp.optim.parallel_noise.ParallelGaussianNoise`'s float64 draws at the same
  position (float32 noise on a float64 sum would leave the sum's low-order bits in the released
  value).
* Secure mode: a 128-bit key from the operating system's CSPRNG (:mod:`secrets`) at every step,
  never a user's seed, and each coordinate the sum of four draws of ``N(0, std²/4)`` (Holohan &
  Braun 2021, as the other noises). Philox is not a cryptographic generator.
* The position, key and state dict are :class:`ParallelGaussianNoise`'s; the stream is another one.
"""

from typing import Optional

import torch

from opacus_dp.optim import keyed_generators as keyed
from opacus_dp.optim.chunked_draws import draw_into
from opacus_dp.optim.noise import SECURE_NUM_DRAWS
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise, check_key, noise_kind_of_state
from opacus_dp.optim.philox import draws as philox
from opacus_dp.maths.huge_pages import empty_like_on_huge_pages

STREAM = "philox4x32-10 box-muller v1"


class PhiloxGaussianNoise(ParallelGaussianNoise):
    """Draws ``N(0, std²)`` tensors from the Philox stream of their position (module doc).

    Args: as :class:`ParallelGaussianNoise` (``generator`` or ``seed`` set the key;
    ``num_threads``: threads per tensor, default ``torch.get_num_threads()``).
    """

    def sample(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """A new tensor like ``reference`` with i.i.d. ``N(0, std²)`` entries (zeros if std = 0); on
        CPU its memory on huge pages where the system allows (:mod:`~opacus_dp.maths.huge_pages`)."""
        if std == 0 or reference.device.type != "cpu":
            return super().sample(reference, std)
        out = empty_like_on_huge_pages(reference.detach())
        self._draw(out, std, add=False)
        return out

    def add_sample_(self, total: torch.Tensor, std: float) -> torch.Tensor:
        """``total += N(0, std²)`` in place, in one pass; bitwise ``sample(total, std) + total``."""
        if std == 0 or not _on_stream(total):
            return super().add_sample_(total, std) if std else total
        self._draw(total, std, add=True)
        return total

    def noised(self, total: torch.Tensor, std: float, reuse: bool = False) -> torch.Tensor:
        """``total + N(0, std²)``: a new tensor (on CPU ``total`` read and the result written once),
        or with ``reuse`` ``total`` itself (:meth:`add_sample_`); bitwise ``sample(total, std) + total``."""
        if reuse or std == 0 or not _on_stream(total):
            return super().noised(total, std, reuse)
        position = self._next_position()
        return philox.noised(total, std, position, self._draws(), self._workers())

    def noised_divided(self, total: torch.Tensor, std: float, reuse: bool, divisor: float) -> torch.Tensor:
        """``(total + N(0, std²)) / divisor``: bitwise :meth:`noised` then ``div_(divisor)`` (the mean's
        division of the step), on CPU in the same pass as the noise (one read and one write)."""
        if std == 0 or not _on_stream(total):
            return self.noised(total, std, reuse).div_(divisor)
        return philox.noised(total, std, self._next_position(), self._draws(), self._workers(), reuse, divisor)

    def _draw(self, target: torch.Tensor, std: float, add: bool) -> None:
        if target.device.type == "cpu" and not _on_stream(target):  # float64: ParallelGaussianNoise's draws
            return super()._draw(target, std, add)
        position = self._next_position()
        if target.device.type != "cpu":
            draw_into(target, std, keyed.device_generator(*position, target.device), self._draws(), add)
        else:
            philox.draw(target, std, position, self._draws(), add, self._workers())

    def _next_position(self):
        position = (self._current_key(), self._step, self._slot)
        self._slot += 1
        return position

    def _draws(self) -> int:
        return SECURE_NUM_DRAWS if self._secure else 1

    def _workers(self) -> int:
        return self.num_threads or torch.get_num_threads()

    def state_dict(self) -> dict:
        """The key and the position of the next draw (nothing in secure mode)."""
        if self._secure:
            return {"secure_mode": True, "philox_noise": {}}
        return {"secure_mode": False, "philox_noise": {
            "key": self._key, "step": self._step, "slot": self._slot, "stream": STREAM}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the state of another noise (another stream) is refused,
        a state saved in secure mode keeps this run's key, with a warning."""
        if self._secure or self._saved_in_secure_mode(state):
            return
        saved: Optional[dict] = state.get("philox_noise")
        if saved is None:
            raise ValueError(f"the noise state was saved with {noise_kind_of_state(state)}, this optimizer "
                             "draws fast_noise='philox': resume with the saved run's setting")
        if saved.get("stream") != STREAM:
            raise ValueError(f"the noise state was saved from the stream {saved.get('stream')!r}, this version "
                             f"draws {STREAM!r}: its draws cannot be continued")
        self._key, self._step, self._slot = check_key(saved["key"]), int(saved["step"]), int(saved["slot"])
        self._small = None


def _on_stream(tensor: torch.Tensor) -> bool:
    """Whether the CPU stream's float32 draws may noise ``tensor``: not a float64 one, whose sum's
    low-order bits would show in ``released - sum`` (always a float32 number with float32 noise;
    :func:`~opacus_dp.optim.philox.draws.refuse_wider_than_float32`), nor one on another device."""
    return tensor.device.type == "cpu" and tensor.dtype != torch.float64

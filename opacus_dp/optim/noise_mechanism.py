"""The noise mechanism a :class:`~opacus_dp.optim.DPOptimizer` draws its noise from.

Independent Gaussian noise (:class:`~opacus_dp.optim.noise.GaussianNoise`, DP-SGD) and noise
correlated across steps (:class:`~opacus_dp.mechanisms.noise.CorrelatedNoise`) both satisfy
:class:`NoiseMechanism`: the optimizer, its step refusal, the per-rank streams of FSDP2 and the
checkpoints use nothing else of a noise object.
"""

from typing import Any, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class NoiseMechanism(Protocol):
    """What the optimizer and checkpoints use of a noise object (one line per member)."""

    generator: Optional[torch.Generator]
    """The generator of the draws (None until created); saved and restored around a refused step."""

    @property
    def secure_mode(self) -> bool:
        """True when every step is seeded from the operating system (nothing to save or seed)."""

    @property
    def shards_alike(self) -> bool:
        """True when each rank may noise its own shard with its own stream (no state across steps)."""

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The generator, created on ``device`` if there is none yet."""

    def stream_base(self) -> bytes:
        """What identifies the stream (generator state or seed), from which a rank's stream is derived."""

    def reseed(self, seed: int) -> None:
        """Continue the draws from a generator seeded with ``seed``."""

    def begin_step(self, device: torch.device) -> None:
        """Start a step (commit what the previous step left, reseed in secure mode)."""

    def sample(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """The noise for the next tensor of the step, shaped like ``reference`` (``std``: ``σ·C_clip``)."""

    def noised(self, total: torch.Tensor, std: float, reuse: bool = False) -> torch.Tensor:
        """``total`` + the noise :meth:`sample` would draw for it: a new tensor, or with ``reuse``
        ``total`` itself (fused where the noise can); the same numbers either way."""

    def discard_step(self) -> None:
        """Forget what the current step drew (the step was refused, nothing released)."""

    def check_schedule(self) -> None:
        """Refuse a step whose index is not the sampling schedule's (no-op without a schedule)."""

    def snapshot(self) -> Any:
        """What :meth:`restore` needs to undo the draws of the coming step."""

    def restore(self, snapshot: Any) -> None:
        """Undo the draws of a step refused after they were made (distributed refusal)."""

    def state_dict(self) -> dict:
        """The state a checkpoint saves."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`, refusing a state that cannot be continued."""

"""Noise-multiplier and clipping-bound schedules (the classes of Opacus's ``opacus.schedulers``)."""

from opacus_dp.schedulers.grad_clip_scheduler import (
    ExponentialGradClip,
    LambdaGradClip,
    StepGradClip,
    _GradClipScheduler,
)
from opacus_dp.schedulers.noise_scheduler import ExponentialNoise, LambdaNoise, StepNoise, _NoiseScheduler

__all__ = [
    "_GradClipScheduler",
    "ExponentialGradClip",
    "LambdaGradClip",
    "StepGradClip",
    "_NoiseScheduler",
    "ExponentialNoise",
    "LambdaNoise",
    "StepNoise",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus

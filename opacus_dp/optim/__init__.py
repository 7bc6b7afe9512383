"""Private optimization: :class:`DPOptimizer` and its strategies (clipping, noise, reduction)."""

from opacus_dp.optim.clipper_registry import make_clipper
from opacus_dp.optim.clipping import Clipper, FlatClipper, PerLayerClipper
from opacus_dp.optim.dp_optimizer import DPOptimizer
from opacus_dp.optim.logical_batches import BatchingPolicy
from opacus_dp.optim.noise import GaussianNoise, noise_std
from opacus_dp.optim.reduction import LocalReducer
from opacus_dp.per_sample_source import AttributeGradSource, GradSource, ModuleGradSource, grad_source_for

__all__ = [
    "DPOptimizer",
    "BatchingPolicy",
    "Clipper",
    "FlatClipper",
    "PerLayerClipper",
    "make_clipper",
    "GaussianNoise",
    "noise_std",
    "LocalReducer",
    "GradSource",
    "AttributeGradSource",
    "ModuleGradSource",
    "grad_source_for",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus

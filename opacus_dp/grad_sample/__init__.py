"""Per-sample gradients: ``GradSampleModule``, the sampler registries and the samplers.

Importing this package registers every dedicated sampler (one module per layer family); those of
optional libraries' layers (Hugging Face ``Conv1D``: :mod:`.hf_conv1d`) once the library is loaded.
"""

from opacus_dp.grad_sample import conv, dp_layers, embedding, embedding_bag, hf_conv1d, hf_rms_norm, linear, norms  # noqa: F401
from opacus_dp.grad_sample.functorch_fallback import functorch_grad_sample
from opacus_dp.grad_sample.grad_sample_module import GradSampleModule
from opacus_dp.grad_sample.bookkeeping import norm_samplers  # noqa: F401,E402  (ghost / bk layer functions)
from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
from opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
from opacus_dp.grad_sample.registry import (
    GRAD_SAMPLERS,
    NORM_SAMPLERS,
    register_grad_sampler,
    register_norm_sampler,
)

__all__ = [
    "GradSampleModule",
    "BookkeepingGradSampleModule",
    "GradSampleModuleFastGradientClipping",
    "GRAD_SAMPLERS",
    "NORM_SAMPLERS",
    "register_grad_sampler",
    "register_norm_sampler",
    "functorch_grad_sample",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
from opacus_dp.grad_sample.mode_wrappers import get_gsm_class, wrap_model  # noqa: E402  (Opacus's names here too)

"""The optimizer of a private run: the :class:`DPOptimizer` around the user's optimizer, its
secure generator, and the criterion of ghost mode."""

from typing import List, Optional

import torch
import torch.nn as nn

from opacus_dp.distributed.configure import make_reducer
from opacus_dp.engine.plan import PrivatePlan
from opacus_dp.grad_sample.bookkeeping.ghost_criterion import GhostCriterion, StepClipping
from opacus_dp.mechanisms.engine import MechanismPlan, correlated_noise
from opacus_dp.model_wrappers import parameter_names
from opacus_dp.optim import BatchingPolicy, DPOptimizer, grad_source_for
from opacus_dp.optim.clipping import Clipper
from opacus_dp.optim.keyed_generators import os_seeded_generator
from opacus_dp.optim.noise import GaussianNoise
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise
from opacus_dp.state_views import OPACUS_1X, StateViews


NOISE_OF_FAST_NOISE = {False: GaussianNoise, True: ParallelGaussianNoise, "philox": PhiloxGaussianNoise}


def secure_generator() -> torch.Generator:
    """A CPU generator whose whole state comes from the operating system's CSPRNG (secure sampling)."""
    return os_seeded_generator("cpu")


def trainable_params(optimizer) -> List[torch.Tensor]:
    """The tensors ``optimizer`` trains (``requires_grad``), in ``param_groups`` order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def make_dp_optimizer(plan: PrivatePlan, optimizer, *, module: nn.Module, grad_sample_module, clipper: Clipper,
                      expected_batch_size: Optional[float], batching: BatchingPolicy,
                      state_views: StateViews = OPACUS_1X, mechanism: Optional[MechanismPlan] = None) -> DPOptimizer:
    """The :class:`DPOptimizer` of ``plan``, built complete from its parts: per-sample gradients
    from ``grad_sample_module``, ``clipper``, the noise (independent, or ``mechanism``'s
    correlated noise), the reducer of ``module`` (:func:`~opacus_dp.distributed.make_reducer`),
    the engine's :class:`BatchingPolicy`; optimizer and wrapper show their state with the
    lifecycle ``state_views`` (:mod:`opacus_dp.state_views`: 1.x for ``make_private``, 0.x for
    ``attach``). No collective: :func:`~opacus_dp.engine.private_step.connect_private_step` follows."""
    grad_sample_module.use_state_views(state_views)
    names = parameter_names(grad_sample_module)
    draws = NOISE_OF_FAST_NOISE[plan.fast_noise]
    noise = correlated_noise(mechanism, draws(generator=plan.noise_generator, secure_mode=plan.secure_mode))
    reducer = make_reducer(module, params=trainable_params(optimizer), names=names, clipper=clipper, noise=noise,
                           step_timeout=plan.step_timeout)
    return DPOptimizer(
        optimizer, noise_multiplier=plan.noise_multiplier, max_grad_norm=plan.max_grad_norm,
        expected_batch_size=expected_batch_size, loss_reduction=plan.loss_reduction, clipping=clipper,
        reducer=reducer, noise=noise, grad_source=grad_source_for(grad_sample_module), param_names=names,
        batching=batching, state_views=state_views)


def ghost_criterion(criterion, loss_reduction: str, module, optimizer):
    """The criterion returned in ghost mode (Opacus 1.6 returns one, default cross-entropy):
    its losses run the two-pass backward (see opacus_dp.grad_sample.bookkeeping.ghost_criterion)."""
    if criterion is None:
        criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
    clipping = StepClipping(params=lambda: optimizer.params, clip_factors=optimizer.clip_factors)
    return GhostCriterion(criterion, loss_reduction, module=module, clipping=clipping)

"""Assembling a private run of ``make_private`` from its :class:`~opacus_dp.engine.plan.PrivatePlan`.

In order: the checks of the objects (optimizer, distributed wrapper, loader sharding, model),
the per-sample-gradient wrapper, the private loader (Poisson, cyclic Poisson for a correlated
mechanism, or the user's), the clipper, the :class:`~opacus_dp.optim.DPOptimizer` built complete
(:func:`~opacus_dp.engine.optimizer.make_dp_optimizer`), and its connection to the other
processes, the budget guard and the accountant (the engine's ``connect``).
"""

from typing import Callable, Optional, Tuple

import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp.data import DPDataLoader, check_sampling, switch_generator
from opacus_dp.data.loader_facts import expected_batch_size_for, fixed_batch_size, sample_rate_of
from opacus_dp.data.sampling_checks import check_batching, check_draws_each_example_once
from opacus_dp.distributed.checks import check_units_agree, share_generator_state
from opacus_dp.engine.arguments import check_optimizer_params, refuse_skipped_empty_draws
from opacus_dp.engine.model import validate_module, wrap_module
from opacus_dp.engine.optimizer import make_dp_optimizer, secure_generator
from opacus_dp.engine.plan import PrivatePlan
from opacus_dp.engine.privacy_units import connect_units, user_ids_of
from opacus_dp.data.unit_loader import UnitDataLoader, unit_loader
from opacus_dp.engine.private_step import (check_distributed, check_distributed_loader, rebind_if_sharded,
                                           shard_if_asked)
from opacus_dp.mechanisms.engine import MechanismPlan, plan_mechanism
from opacus_dp.optim.adaptive_clipping import adaptive_clipper
from opacus_dp.optim.clipper_registry import make_clipper
from opacus_dp.optim.logical_batches import BatchingPolicy

Connect = Callable[..., None]  # (module, dp_optimizer, sample_rate, mechanism) -> None


def mechanism_of(plan: PrivatePlan, data_loader) -> Optional[MechanismPlan]:
    """The correlated mechanism's plan for ``data_loader`` (None for independent noise)."""
    return plan_mechanism(plan.noise_mechanism, data_loader=data_loader, bands=plan.bands, epochs=plan.epochs,
                          poisson_sampling=plan.poisson_sampling, clipping=plan.clipping)


def assemble(plan: PrivatePlan, *, module: nn.Module, optimizer, data_loader: DataLoader,
             mechanism: Optional[MechanismPlan], connect: Connect) -> Tuple[nn.Module, object, DataLoader]:
    """``(wrapper, dp_optimizer, loader)`` of ``plan`` (module doc); nothing is left attached if
    a step fails."""
    check_optimizer_params(module, optimizer)
    optimizer = rebind_if_sharded(optimizer, shard_if_asked(module, plan.fsdp), module)
    world_size = check_distributed(module)
    check_distributed_loader(data_loader, world_size, plan.poisson_sampling)
    validate_module(module)
    gsm = wrap_module(module, grad_sample_mode=plan.grad_sample_mode, batch_first=plan.batch_first,
                      loss_reduction=plan.loss_reduction, skip_weight_grads=plan.skip_weight_grads)
    try:
        gsm.configure_model_checks(plan.check_sample_independence, plan.public_buffers)
        if plan.poisson_sampling:
            gsm.forbid_grad_accumulation()
        loader = private_loader(plan, data_loader, mechanism, distributed=world_size > 1)
        if plan.groups_rows:
            sampler = loader.batch_sampler
            check_units_agree(sampler.units, world_size, settings=dict(
                max_examples_per_user=sampler.max_rows_per_unit, unit_gradient=sampler.unit_gradient,
                augmentation_multiplicity=sampler.multiplicity))
            connect_units(gsm, loader)
        sample_rate = sample_rate_of(loader)
        dp_optimizer = _optimizer(plan, optimizer, module, gsm, loader, mechanism, world_size)
        connect(module, dp_optimizer, sample_rate, mechanism)  # all ranks agree from here on
        if world_size == 1 and (type(loader) is DPDataLoader or isinstance(loader, UnitDataLoader)):
            # one step per batch (step_per_batch.py); the cyclic loader checks its own schedule
            loader.step_per_batch.follow(dp_optimizer)
    except Exception:
        if gsm is not module:
            gsm.close()
        raise
    if plan.poisson_sampling and world_size > 1:
        share_generator_state(loader.generator)  # one global Poisson stream
    return gsm, dp_optimizer, loader


def _optimizer(plan: PrivatePlan, optimizer, module, gsm, loader, mechanism, world_size: int):
    """The DPOptimizer: the mean divides by the expected per-process batch ``⌊q·N⌋ / W`` (a
    mechanism's ``⌊q_g·N/b⌋ / W``); adaptive clipping's defaults see the global one."""
    units = getattr(loader.batch_sampler, "num_units", len(loader.dataset))  # users, when sampled by user
    expected = expected_batch_size_for(units, sample_rate_of(loader))
    if plan.clipping == "adaptive":
        clipper = adaptive_clipper(plan.max_grad_norm, expected_batch_size=expected, **plan.options)
    else:
        clipper = make_clipper(plan.clipping, plan.max_grad_norm, **plan.options)
    if mechanism is not None:
        expected = mechanism.expected_batch_size() / world_size
    elif world_size > 1:
        expected = expected / world_size
    # Poisson batches: one per step, split only by BatchMemoryManager; fixed-size batches:
    # a step may not combine more than one
    batching = BatchingPolicy(poisson_batches=True) if plan.poisson_sampling else \
        BatchingPolicy(max_batch_size=fixed_batch_size(loader))
    return make_dp_optimizer(plan, optimizer, module=module, grad_sample_module=gsm, clipper=clipper,
                             expected_batch_size=expected, batching=batching, mechanism=mechanism)


def private_loader(plan: PrivatePlan, data_loader: DataLoader, mechanism: Optional[MechanismPlan], *,
                   distributed: bool) -> DataLoader:
    """The loader of the run: a mechanism's cyclic Poisson loader, the engine's Poisson loader, or
    (``poisson_sampling=False``) the user's, checked, with the secure generator in secure mode."""
    generator = secure_generator() if plan.secure_mode else None
    if plan.groups_rows:  # Poisson sampling of users / augmented examples
        return unit_loader(data_loader, user_ids=user_ids_of(plan, data_loader.dataset) if plan.privacy_unit == "user"
                           else None, max_examples_per_user=plan.max_examples_per_user,
                           augmentation_multiplicity=plan.augmentation_multiplicity, unit_gradient=plan.unit_gradient,
                           generator=generator, distributed=distributed, batch_first=plan.batch_first)
    if mechanism is not None:  # the sampling its analysis needs (opacus_dp.mechanisms.engine)
        return mechanism.loader(data_loader, generator=generator, distributed=distributed, batch_first=plan.batch_first)
    if plan.poisson_sampling:
        return DPDataLoader.from_data_loader(data_loader, generator=generator, distributed=distributed,
                                             batch_first=plan.batch_first)
    check_batching(data_loader, "make_private(poisson_sampling=False)")
    check_draws_each_example_once(data_loader, "make_private(poisson_sampling=False)")
    refuse_skipped_empty_draws(data_loader)
    check_sampling(data_loader, poisson_expected=False)
    if generator is None:
        return data_loader
    try:
        return switch_generator(data_loader=data_loader, generator=generator)
    except ValueError as error:  # nothing random to secure (e.g. a SequentialSampler)
        raise ValueError(
            f"secure_mode=True: the loader's batches are not drawn with a generator that "
            f"could be replaced by the secure one ({error}); use poisson_sampling=True "
            "(recommended) or a shuffled loader (shuffle=True)") from None

"""Setting up a DP optimizer for a model sharded with FSDP2 (what ``make_private``/``attach`` call).

:func:`fsdp_reducer` refuses what the sharded step does not support (adaptive clipping, whose noisy count would need
a rank to noise it alone, and correlated noise across steps) and every trainable tensor that
is not one of FSDP2's ``Shard(0)`` shards; then builds the
:class:`~opacus_dp.distributed.reduce_scatter.ReduceScatterReducer` and gives the rank its own
noise stream (:mod:`~opacus_dp.distributed.noise_streams`); once the optimizer exists,
:func:`connect_fsdp` checks, collectively, that all ranks agree on the settings, and every forward
and backward pass of ``module`` then first meets the other ranks, bounded by ``step_timeout``
(:mod:`~opacus_dp.distributed.fsdp_rendezvous`).
"""

import torch.distributed as dist
import torch.nn as nn

from opacus_dp.distributed.checks import check_mean_divisor, check_same_on_all_ranks
from opacus_dp.distributed.fsdp import check_sharded_parameters, fsdp_modules, parameter_groups
from opacus_dp.distributed.noise_streams import give_rank_its_stream
from opacus_dp.distributed.reduce_scatter import ReduceScatterReducer
from opacus_dp.distributed.step_wait import StepTimeout
from opacus_dp.model_wrappers import parameter_names
from opacus_dp.optim.dp_optimizer_parts import STEP_SETTINGS


def fsdp_world_size(module: nn.Module) -> int:
    """Processes of the mesh ``module``'s ``fully_shard`` parameters live on."""
    group_of = parameter_groups(module)
    if not group_of:
        return dist.get_world_size() if dist.is_initialized() else 1
    return next(iter(group_of)).device_mesh.size()


def _refuse_unsupported(clipper, noise) -> None:
    if clipper.releases_statistic:
        raise ValueError("clipping='adaptive' is not available with FSDP2 (fully_shard): use "
                         "clipping='flat' or 'per_layer'")
    if not noise.shards_alike:
        raise ValueError("correlated noise mechanisms are not available with FSDP2 (fully_shard): "
                         "use noise_mechanism='independent'")


def fsdp_reducer(module: nn.Module, *, params, names, clipper, noise, step_timeout: StepTimeout = None):
    """The reduce-scatter reducer of ``module`` (module doc) for the trainable tensors ``params``
    (named by ``names``) and the rank's own noise stream; refuses what the sharded step does
    not support. No collective."""
    _refuse_unsupported(clipper, noise)
    check_sharded_parameters(params, {**parameter_names(module), **names}, parameter_groups(module))
    reducer = ReduceScatterReducer(module, step_timeout=step_timeout, settings=len(STEP_SETTINGS))
    give_rank_its_stream(noise, reducer.rank)
    return reducer


def connect_fsdp(module: nn.Module, optimizer, *, sample_rate) -> None:
    """Once ``optimizer`` (a DPOptimizer with :func:`fsdp_reducer`'s reducer) exists: all ranks
    agree on the settings (collectively), then every forward and backward pass meets the others."""
    reducer = optimizer.reducer
    check_same_on_all_ranks({"world_size": reducer.world_size, "sample_rate": sample_rate,
                             "fully_shard modules": float(len(fsdp_modules(module))),
                             **optimizer.settings_ranks_share()}, reducer.process_group)
    check_mean_divisor(optimizer)
    reducer.install_rendezvous(module)

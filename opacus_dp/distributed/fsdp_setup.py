"""Setting up a DP optimizer for a model sharded with FSDP2 (what ``make_private``/``attach`` call).

:func:`configure_fsdp_optimizer` checks, collectively, that all ranks agree on the settings;
refuses what the sharded step does not support (adaptive clipping, whose noisy count would need
a rank to noise it alone, and correlated noise across steps) and every trainable tensor that
is not one of FSDP2's ``Shard(0)`` shards; then installs the
:class:`~opacus_dp.distributed.reduce_scatter.ReduceScatterReducer` and gives the rank its own
noise stream (:mod:`~opacus_dp.distributed.noise_streams`); every forward and backward pass of
``module`` then first meets the other ranks, bounded by ``step_timeout``
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
from opacus_dp.optim.adaptive_clipping import AdaptiveClipper
from opacus_dp.optim.noise import GaussianNoise


def fsdp_world_size(module: nn.Module) -> int:
    """Processes of the mesh ``module``'s ``fully_shard`` parameters live on."""
    group_of = parameter_groups(module)
    if not group_of:
        return dist.get_world_size() if dist.is_initialized() else 1
    return next(iter(group_of)).device_mesh.size()


def _refuse_unsupported(optimizer) -> None:
    if isinstance(optimizer.clipper, AdaptiveClipper):
        raise ValueError("clipping='adaptive' is not available with FSDP2 (fully_shard): use "
                         "clipping='flat' or 'per_layer'")
    if type(optimizer.noise) is not GaussianNoise:
        raise ValueError("correlated noise mechanisms are not available with FSDP2 (fully_shard): "
                         "use noise_mechanism='independent'")


def configure_fsdp_optimizer(module: nn.Module, optimizer, *, sample_rate, step_timeout: StepTimeout = None) -> None:
    """Make ``optimizer`` (a DPOptimizer) reduce-scatter into ``module``'s FSDP2 shards (module doc)."""
    _refuse_unsupported(optimizer)
    group_of = parameter_groups(module)
    names = {**parameter_names(module), **optimizer.param_names}
    check_sharded_parameters(optimizer.params, names, group_of)
    reducer = ReduceScatterReducer(module, step_timeout=step_timeout,
                                   settings=len(optimizer._step_settings()))
    check_same_on_all_ranks({"world_size": reducer.world_size, "sample_rate": sample_rate,
                             "fully_shard modules": float(len(fsdp_modules(module))),
                             **optimizer.settings_ranks_share()}, reducer.process_group)
    check_mean_divisor(optimizer)
    optimizer.reducer = reducer
    reducer.install_rendezvous(module)
    give_rank_its_stream(optimizer.noise, reducer.rank)

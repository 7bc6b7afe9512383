"""The wrapped model's replicas: ``nn.DataParallel`` copies of the hooked layers and the data-parallel
wrappers inside the model, as the per-sample-gradient wrapper meets them."""

from typing import Dict

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from opacus_dp.module_parameters import own_parameters


def master_grad_samples(
    master: nn.Module, layer: nn.Module, grad_samples: Dict[torch.Tensor, torch.Tensor]
) -> Dict[torch.Tensor, torch.Tensor]:
    """Re-key a sampler's result from ``layer``'s tensors to ``master``'s parameters.

    ``layer`` is the module the hook was called with: ``master`` itself, or a replica
    made by ``nn.DataParallel`` whose parameters are plain tensor attributes derived from
    the master's (same names); the mapping goes through those names.
    """
    if layer is master:
        return grad_samples  # keyed by the canonical tensors already (``GradSampleModule._per_sample_grads``)
    by_id = {id(getattr(layer, n)): p for n, p in own_parameters(master)}
    return {by_id[id(t)]: gs for t, gs in grad_samples.items()}


def has_replicas(module: nn.Module) -> bool:
    """Whether ``module`` holds an ``nn.DataParallel`` or a ``DistributedDataParallel``."""
    return any(isinstance(m, (nn.DataParallel, DistributedDataParallel)) for m in module.modules())


def has_data_parallel(module: nn.Module) -> bool:
    """Whether ``module`` holds an ``nn.DataParallel`` (whose replicas' calls are not traced)."""
    return any(isinstance(m, nn.DataParallel) for m in module.modules())


def needs_weight_grads(module: nn.Module) -> bool:
    """True when autograd's weight gradients are used by something other than the optimizer: the
    replicas of ``nn.DataParallel`` (their gradients reach the master parameters) and a DDP with
    ``static_graph=True`` (it keeps its own synchronisation). Other DDP models have theirs
    switched off by the engine (:mod:`opacus_dp.distributed.ddp_hooks`), so nothing reads them."""
    return any(isinstance(m, nn.DataParallel) or (isinstance(m, DistributedDataParallel)
                                                  and getattr(m, "static_graph", False))
               for m in module.modules())

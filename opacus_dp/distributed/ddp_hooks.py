"""A DDP communication hook that communicates nothing.

``torch.nn.parallel.DistributedDataParallel`` all-reduces the *unclipped* gradients
during every backward pass. In DP-SGD those averages are useless (the optimizer replaces
``p.grad`` by the clipped, noised sum) and would double the traffic, so the engine
registers :func:`local_gradients_hook`: each bucket's future resolves immediately to the
rank's own gradients, and the single reduction of the step is done by the optimizer's
:class:`~opacus_dp.distributed.reducers.AllReduceReducer` on the clipped sums.

DDP also runs collectives inside ``forward`` (a broadcast of the buffers, a one-time rebuild of
its buckets), one per forward call. DP-SGD ranks do not make the same number of forward calls
per step (``BatchMemoryManager`` cuts each rank's own Poisson batch into as many pieces as it
needs, down to none), so those collectives would meet the optimizer's all-reduce on another
rank and block. :func:`detach_ddp_synchronisation` turns DDP's own gradient synchronisation
off for good (as inside ``no_sync()``), which also stops the forward-time collectives: the
parameters stay identical because every rank applies the same all-reduced update, and the
buffers were broadcast when DDP wrapped the model (buffers changed from the data, such as
BatchNorm's statistics, are refused by the validator anyway). A DDP built with
``static_graph=True`` needs its gradient hooks in every backward pass, so it keeps its
synchronisation: with it, every rank must run the same number of forward passes per step
(``BatchMemoryManager`` and ``virtual_step`` may not; use DPDDP or a DDP without static_graph).
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def local_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Comm hook: keep this rank's gradients as they are, send zero bytes."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def has_local_gradients_hook(ddp: DistributedDataParallel) -> bool:
    """True iff :func:`local_gradients_hook` is registered on ``ddp``."""
    return any(hook is local_gradients_hook for hook, _ in getattr(ddp, "_comm_hooks", []))


def install_local_gradients_hook(ddp: DistributedDataParallel) -> None:
    """Register :func:`local_gradients_hook` on ``ddp`` (idempotent).

    DDP accepts one comm hook per model and none after the first backward pass, so wrap
    the model and call ``make_private``/``attach`` before training.
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"expected DistributedDataParallel, got {type(ddp).__name__}")
    if has_local_gradients_hook(ddp):
        return
    if getattr(ddp, "_comm_hooks", []):
        raise ValueError(
            "this DistributedDataParallel model already has a communication hook; DP-SGD needs "
            "its own hook (gradients are reduced after clipping): wrap the model in a fresh "
            "DistributedDataParallel without register_comm_hook"
        )
    try:
        ddp.register_comm_hook(state=None, hook=local_gradients_hook)
    except RuntimeError as e:
        raise ValueError(
            "could not register the DP-SGD communication hook on DistributedDataParallel "
            f"({e}); call make_private/attach right after wrapping the model, before any "
            "backward pass, and do not register another comm hook"
        ) from e


def detach_ddp_synchronisation(ddp: DistributedDataParallel) -> None:
    """Stop ``ddp``'s own collectives in forward and backward (module doc; not for a static graph)."""
    if getattr(ddp, "static_graph", False):
        return
    ddp.require_backward_grad_sync = False
    ddp.require_forward_param_sync = False


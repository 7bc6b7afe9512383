"""Distributed DP-SGD: across processes (DDP / DPDDP) and across nn.DataParallel replicas.

* :class:`DifferentiallyPrivateDistributedDataParallel` — model wrapper (rank-0 broadcast).
* :class:`AllReduceReducer` — one all-reduce of the clipped sums per step, noise on rank 0;
  a step refused on one rank is refused on all (:class:`StepRefusedError`), and a rank that does
  not join within ``step_timeout`` is named (:class:`StepCollectiveError`); ranks out of step (one
  skipped a batch) are refused on every rank (:class:`RanksOutOfStepError`, :mod:`step_clock`).
* :func:`local_gradients_hook` — DDP comm hook that stops DDP's unclipped all-reduce.
* :mod:`~opacus_dp.distributed.configure` — what the PrivacyEngine calls.
* :mod:`~opacus_dp.distributed.data_parallel` — per-sample gradients inside nn.DataParallel.
"""

from opacus_dp.distributed.average import average_gradients
from opacus_dp.distributed.checks import check_same_on_all_ranks, parameters_in_sync
from opacus_dp.distributed.configure import (
    check_data_loader_world_size,
    connect_reducer,
    make_reducer,
    find_distributed_wrapper,
    find_parallel_wrapper,
    validate_parallel_module,
    world_size_of,
)
from opacus_dp.distributed.ddp_hooks import install_local_gradients_hook, local_gradients_hook
from opacus_dp.distributed.dpddp import DifferentiallyPrivateDistributedDataParallel
from opacus_dp.distributed.reducers import AllReduceReducer
from opacus_dp.distributed.step_clock import RanksOutOfStepError
from opacus_dp.distributed.step_wait import StepCollectiveError
from opacus_dp.optim.step_refusal import StepRefusedError

DPDDP = DifferentiallyPrivateDistributedDataParallel

__all__ = [
    "AllReduceReducer",
    "DPDDP",
    "DifferentiallyPrivateDistributedDataParallel",
    "RanksOutOfStepError",
    "StepCollectiveError",
    "StepRefusedError",
    "average_gradients",
    "check_data_loader_world_size",
    "check_same_on_all_ranks",
    "connect_reducer",
    "make_reducer",
    "find_distributed_wrapper",
    "find_parallel_wrapper",
    "install_local_gradients_hook",
    "local_gradients_hook",
    "parameters_in_sync",
    "validate_parallel_module",
    "world_size_of",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus

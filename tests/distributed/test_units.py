"""In-process checks of the distributed pieces (a one-process gloo group; no spawning)."""


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_dp.optim.clipping import FlatClipper
from opacus_dp.optim.noise import GaussianNoise
from opacus_dp.optim.reduction import StepRelease
from opacus_dp.distributed import (
    AllReduceReducer,
    DifferentiallyPrivateDistributedDataParallel,
    check_data_loader_world_size,
    check_same_on_all_ranks,
    connect_reducer,
    make_reducer,
    find_distributed_wrapper,
    find_parallel_wrapper,
    install_local_gradients_hook,
    local_gradients_hook,
    parameters_in_sync,
    validate_parallel_module,
    world_size_of,
)
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.optim import DPOptimizer, LocalReducer
from tests.distributed.cpu_data_parallel import CPUDataParallel


def test_dpddp_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already active in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DifferentiallyPrivateDistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        AllReduceReducer()


def test_dpddp_forwards_and_keeps_opacus_state_dict_keys(group):
    inner = nn.Linear(3, 2)
    model = DifferentiallyPrivateDistributedDataParallel(inner)
    x = torch.randn(4, 3)
    assert torch.equal(model(x), inner(x))
    assert set(model.state_dict()) == {"module.weight", "module.bias"}
    assert model.world_size == 1
    from opacus_dp.layers import DifferentiallyPrivateDistributedDataParallel as compat

    assert compat is DifferentiallyPrivateDistributedDataParallel


def test_reducer_of_one_process_sends_nothing(group):
    """W = 1: the sum over the ranks is the process's own (the buckets of several processes, one
    per dtype, are counted by tests/distributed/test_ddp.py on 2 ranks)."""
    reducer = AllReduceReducer()
    tensors = [torch.randn(3, 2), torch.randn(5), torch.randn(2, dtype=torch.float64)]
    copies = [t.clone() for t in tensors]
    out = reducer.reduce(StepRelease(tensors))  # no noise given: the sum over the one rank
    assert all(o is t for o, t in zip(out, tensors)) and all(torch.equal(a, b) for a, b in zip(out, copies))
    assert reducer.num_all_reduces == 0 and reducer.bytes_reduced == 0
    assert reducer.world_size == 1 and reducer.draws_noise  # rank 0 adds the noise


def test_comm_hook_is_installed_once_and_a_foreign_hook_is_refused(group):
    ddp = DistributedDataParallel(nn.Linear(3, 2))
    install_local_gradients_hook(ddp)
    install_local_gradients_hook(ddp)  # idempotent
    assert [h for h, _ in ddp._comm_hooks] == [local_gradients_hook]
    other = DistributedDataParallel(nn.Linear(3, 2))
    other.register_comm_hook(None, lambda state, bucket: local_gradients_hook(state, bucket))
    with pytest.raises(ValueError, match="already has a communication hook"):
        install_local_gradients_hook(other)


def test_wrappers_are_found_through_grad_sample_module(group):
    ddp = DistributedDataParallel(nn.Linear(3, 2))
    gsm = GradSampleModule(ddp)
    assert find_parallel_wrapper(gsm) is ddp and find_distributed_wrapper(gsm) is ddp
    assert world_size_of(gsm) == 1
    dp = CPUDataParallel(nn.Linear(3, 2), 2)
    assert find_parallel_wrapper(dp) is dp and find_distributed_wrapper(dp) is None
    assert world_size_of(nn.Linear(3, 2)) == 1
    validate_parallel_module(nn.Linear(3, 2))  # world size 1: an unwrapped model is fine
    gsm.close()


def test_consistency_checks_pass_on_one_rank(group):
    check_same_on_all_ranks({"sample_rate": 0.1, "noise_multiplier": None})
    assert parameters_in_sync(nn.Linear(3, 2))


def _Optimizer(module, expected_batch_size):
    """A DPOptimizer of ``module`` built with the reducer make_reducer chose for it."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    params = [p for p in module.parameters()]
    clipper, noise = FlatClipper(1.0), GaussianNoise()
    reducer = make_reducer(module, params=params, names={}, clipper=clipper, noise=noise)
    return DPOptimizer(optimizer, noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipper, noise=noise,
                       expected_batch_size=expected_batch_size, reducer=reducer)


def test_the_reducer_is_chosen_before_the_optimizer_and_connected_after(group):
    ddp = DistributedDataParallel(nn.Linear(3, 2))
    optimizer = _Optimizer(ddp, expected_batch_size=4)
    assert isinstance(optimizer.reducer, AllReduceReducer) and not ddp._comm_hooks
    connect_reducer(ddp, optimizer, sample_rate=0.1)
    assert [h for h, _ in ddp._comm_hooks] == [local_gradients_hook]
    local = nn.Linear(3, 2)
    local_optimizer = _Optimizer(local, expected_batch_size=4)
    connect_reducer(local, local_optimizer, sample_rate=0.1)
    assert isinstance(local_optimizer.reducer, LocalReducer)


def test_mean_over_the_actual_batch_is_refused_under_ddp(group):
    module = DifferentiallyPrivateDistributedDataParallel(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="expected batch size"):
        connect_reducer(module, _Optimizer(module, expected_batch_size=None), sample_rate=0.1)


def test_loader_sharding_must_match_the_world():
    data = TensorDataset(torch.arange(12))
    sharded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    check_data_loader_world_size(sharded, 2, poisson_sampling=False)
    with pytest.raises(ValueError, match="num_replicas=2 processes but the process group has world_size=3"):
        check_data_loader_world_size(sharded, 3, poisson_sampling=True)
    plain = DataLoader(data, batch_size=2)
    check_data_loader_world_size(plain, 2, poisson_sampling=True)  # the engine shards it itself
    with pytest.raises(ValueError, match="poisson_sampling=False"):
        check_data_loader_world_size(plain, 2, poisson_sampling=False)
    check_data_loader_world_size(plain, 1, poisson_sampling=False)

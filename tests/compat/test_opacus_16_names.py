"""Opacus 1.6 names that scripts import: ``opacus.grad_sample.functorch``'s helpers and the
distributed optimizers of ``opacus.optimizers``.

Oracles: per-sample gradients from an autograd loop over single samples; the distributed step
against one process on the concatenated batch (clipped by hand), and the noise std against
``σ·C / (B·W)`` (noise added once over all ranks).
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tests.distributed.spawn import run_on_ranks

WORLD = 2
B_LOCAL = 4


def _oracle(layer, x, g, sample_dim=0):
    """``[{name: ∂ Σ(f(x_i)·g_i) / ∂θ}]`` per sample, by autograd on one sample at a time."""
    names = [n for n, _ in layer.named_parameters()]
    rows = []
    for i in range(x.shape[sample_dim]):
        xi, gi = x.narrow(sample_dim, i, 1), g.narrow(sample_dim, i, 1)
        grads = torch.autograd.grad((layer(xi) * gi).sum(), list(layer.parameters()))
        rows.append(dict(zip(names, grads)))
    return rows


def _check(layer, per_sample, oracle):
    for name, p in layer.named_parameters():
        expected = torch.stack([row[name] for row in oracle])
        torch.testing.assert_close(per_sample[p], expected, rtol=1e-5, atol=1e-6)


def test_ft_compute_per_sample_gradient_matches_an_autograd_loop():
    from opacus_dp.grad_sample.functorch import ft_compute_per_sample_gradient

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # nested: all parameters
    x, g = torch.randn(6, 5), torch.randn(6, 3)
    per_sample = ft_compute_per_sample_gradient(layer, [x], g)
    assert set(per_sample) == set(layer.parameters())
    _check(layer, per_sample, _oracle(layer, x, g))
    assert hasattr(layer, "ft_compute_sample_grad")  # prepared once, as in Opacus


class _AlongSequence(nn.Module):
    """Sequence-first ``(T, B, D)``: each output step sums the projected steps up to it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2)

    def forward(self, x):
        return self.proj(x).cumsum(dim=0)


def test_prepare_layer_sequence_first_puts_each_sample_on_dimension_1():
    from opacus_dp.grad_sample.functorch import prepare_layer

    torch.manual_seed(1)
    layer = _AlongSequence()
    x, g = torch.randn(5, 4, 3), torch.randn(5, 4, 2)  # (T, B, ·)
    prepare_layer(layer, batch_first=False)
    params = list(layer.parameters())
    grads = layer.ft_compute_sample_grad(params, x.transpose(0, 1), g.transpose(0, 1))  # batch on dim 0
    _check(layer, dict(zip(params, grads)), _oracle(layer, x, g, sample_dim=1))


def test_make_functional_runs_the_module_with_given_parameters():
    from opacus_dp.grad_sample.functorch import make_functional

    torch.manual_seed(2)
    mod = nn.Linear(4, 3)
    fmodel, params = make_functional(mod)
    assert [p is q for p, q in zip(params, mod.parameters())] == [True, True]
    x = torch.randn(2, 4)
    torch.testing.assert_close(fmodel(params, x), mod(x))
    weight, bias = torch.randn(3, 4), torch.randn(3)
    torch.testing.assert_close(fmodel((weight, bias), x), x @ weight.T + bias)
    _, detached = make_functional(mod, disable_autograd_tracking=True)
    assert all(not p.requires_grad for p in detached)
    with pytest.raises(ValueError, match="takes 2 parameter tensors"):
        fmodel((weight,), x)


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(3), nn.EmbeddingBag(5, 2)], ids=["buffers", "embedding_bag"])
def test_prepare_layer_refuses_what_opacus_refuses(layer):
    from opacus_dp.grad_sample.functorch import prepare_layer

    with pytest.raises(NotImplementedError, match="prepare_layer"):
        prepare_layer(layer)


def test_names_resolve_through_install_as_opacus():
    script = textwrap.dedent("""
        import opacus_dp
        opacus_dp.install_as_opacus()
        from opacus.grad_sample.functorch import make_functional, prepare_layer, ft_compute_per_sample_gradient
        from opacus.optimizers import (DistributedDPOptimizer, SimpleDistributedPerLayerOptimizer,
                                       DistributedDPOptimizerFastGradientClipping, FSDPOptimizerFastGradientClipping)
        from opacus.optimizers.ddpoptimizer import DistributedDPOptimizer as D
        from opacus.optimizers.ddp_perlayeroptimizer import DistributedPerLayerOptimizer
        import opacus.optimizers.ddpoptimizer_fast_gradient_clipping
        import opacus.optimizers.fsdpoptimizer_fast_gradient_clipping
        assert D is DistributedDPOptimizer is opacus_dp.optimizers.DistributedDPOptimizer
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_get_optimizer_class_names_the_distributed_classes():
    from opacus_dp.optimizers import (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping,
                                      SimpleDistributedPerLayerOptimizer, get_optimizer_class)

    assert get_optimizer_class("flat", True) is DistributedDPOptimizer
    assert get_optimizer_class("per_layer", True, "ew") is SimpleDistributedPerLayerOptimizer
    assert get_optimizer_class("flat", True, "ghost") is DistributedDPOptimizerFastGradientClipping
    with pytest.raises(ValueError, match="make_private"):
        get_optimizer_class("adaptive", True)


@pytest.mark.parametrize("name", ["DistributedDPOptimizerFastGradientClipping", "FSDPOptimizerFastGradientClipping"])
def test_fast_gradient_clipping_distributed_names_refuse_construction(name):
    import opacus_dp.optimizers as optimizers

    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match=rf"{name} cannot be built.*make_private\(.*grad_sample_mode='ghost'"):
        getattr(optimizers, name)(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)


def test_distributed_optimizer_needs_a_process_group():
    from opacus_dp.optimizers import DistributedDPOptimizer

    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)


def _distributed_step(rank, world_size, clipping, sigma):
    """One step of a directly built Opacus-style distributed optimizer on rank ``rank``'s own data."""
    from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.optim import DPOptimizer
    from opacus_dp.optimizers import (DistributedDPOptimizer, DPPerLayerOptimizer,
                                      SimpleDistributedPerLayerOptimizer)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 2))
    x_all, y_all = torch.randn(world_size * B_LOCAL, 40), torch.randint(0, 2, (world_size * B_LOCAL,))
    before = [p.detach().clone() for p in model.parameters()]
    dp_model = DPDDP(GradSampleModule(model))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    if clipping == "flat":
        optimizer = DistributedDPOptimizer(sgd, noise_multiplier=sigma, max_grad_norm=0.05,
                                           expected_batch_size=B_LOCAL)
    else:
        optimizer = SimpleDistributedPerLayerOptimizer(sgd, noise_multiplier=sigma, max_grad_norm=[0.02] * 4,
                                                       expected_batch_size=B_LOCAL)
    x, y = x_all[rank * B_LOCAL:(rank + 1) * B_LOCAL], y_all[rank * B_LOCAL:(rank + 1) * B_LOCAL]
    nn.functional.cross_entropy(dp_model(x), y).backward()
    optimizer.step()
    local = DPOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), noise_multiplier=0.0,
                        max_grad_norm=1.0, expected_batch_size=1)
    flags = (isinstance(optimizer, DistributedDPOptimizer), isinstance(local, DistributedDPOptimizer),
             isinstance(optimizer, DPPerLayerOptimizer))
    update = [(b - p.detach()) for b, p in zip(before, model.parameters())]  # lr = 1: the gradient
    return {"update": update, "flags": flags, "x": x_all, "y": y_all}


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_distributed_optimizer_matches_one_process_on_the_concatenated_batch(clipping):
    from tests.distributed.oracle import clipped_mean_update

    results = run_on_ranks(_distributed_step, WORLD, clipping, 0.0, timeout=90)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 2))
    bound = 0.05 if clipping == "flat" else [0.02] * 4
    expected = clipped_mean_update(model, nn.functional.cross_entropy, results[0]["x"], results[0]["y"],
                                   bound, WORLD * B_LOCAL)
    for rank in range(WORLD):
        for got, want in zip(results[rank]["update"], expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        assert results[rank]["flags"] == (True, False, clipping == "per_layer")


def test_distributed_optimizer_adds_the_noise_once():
    """A loss with zero gradients: the update is the noise alone, of std σ·C / (B·W); noise on
    every rank would give √W times that. 2 602 entries (relative standard error of the sample
    std ≈ 1/√(2n) = 1.4%): within 5% but for a 3.6-standard-error deviation (seeded)."""
    results = run_on_ranks(_distributed_step_noise, WORLD, timeout=90)
    assert len(results[0]["update"]) == 4
    update = torch.cat([u.reshape(-1) for u in results[0]["update"]])
    torch.testing.assert_close(update, torch.cat([u.reshape(-1) for u in results[1]["update"]]))
    expected_std = 1.0 * 0.5 / (B_LOCAL * WORLD)
    assert abs(update.std().item() / expected_std - 1) < 0.05


def _distributed_step_noise(rank, world_size):
    return _distributed_step_with(rank, world_size, sigma=1.0, bound=0.5)


def _distributed_step_with(rank, world_size, sigma, bound):
    from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.optimizers import DistributedDPOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 2))
    before = [p.detach().clone() for p in model.parameters()]
    dp_model = DPDDP(GradSampleModule(model))
    optimizer = DistributedDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=sigma,
                                       max_grad_norm=bound, expected_batch_size=B_LOCAL)
    torch.manual_seed(100 + rank)
    (dp_model(torch.randn(B_LOCAL, 40)) * 0).sum().backward()  # per-sample gradients 0
    optimizer.step()
    return {"update": [(b - p.detach()) for b, p in zip(before, model.parameters())]}

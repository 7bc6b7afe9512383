"""Correlated noise: streaming recursion against dense C⁻¹, C = I against DP-SGD, statistics,
checkpoints."""

import copy

import pytest
import torch
import torch.nn as nn

from opacus_dp.mechanisms import toeplitz
from opacus_dp.mechanisms.noise import CorrelatedNoise
from opacus_dp.mechanisms.strategies import make_strategy
from opacus_dp.optim import DPOptimizer, GaussianNoise

SHAPES = [(3, 2), (5,)]


def run(noise, steps, std=1.0, shapes=SHAPES):
    out = []
    for _ in range(steps):
        noise.begin_step(torch.device("cpu"))
        out.append([noise.sample(torch.zeros(s), std) for s in shapes])
    return out


def strategies(tmp_path):
    return [make_strategy("banded", steps=12, bands=4, cache_dir=tmp_path),
            make_strategy("blt", steps=12, buffers=2, period=4, cache_dir=tmp_path),
            make_strategy("tree", steps=12, period=4)]


def test_streaming_noise_is_c_inverse_of_the_draws(tmp_path):
    for strategy in strategies(tmp_path)[:2]:
        n = strategy.steps
        z = run(CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(3))), n)
        w = run(GaussianNoise(torch.Generator().manual_seed(3)), n, std=strategy.sensitivity)
        C = toeplitz.dense(strategy.column(), n)
        for slot in range(len(SHAPES)):
            W = torch.stack([step[slot].reshape(-1) for step in w]).double()
            Z = torch.stack([step[slot].reshape(-1) for step in z]).double()
            assert torch.allclose(Z, torch.linalg.solve(C, W), atol=1e-5), strategy.kind


def test_identity_strategy_is_dp_sgd_bit_for_bit(tmp_path):
    for strategy in (make_strategy("independent", steps=5), make_strategy("banded", steps=5, bands=1, cache_dir=tmp_path)):
        z = run(CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(7))), 5, std=0.37)
        w = run(GaussianNoise(torch.Generator().manual_seed(7)), 5, std=0.37)
        assert all(torch.equal(a, b) for za, wa in zip(z, w) for a, b in zip(za, wa))


def test_optimizer_with_identity_mechanism_updates_bit_for_bit():
    def train(mechanism):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.3, max_grad_norm=0.7,
                          expected_batch_size=8, generator=torch.Generator().manual_seed(11))
        if mechanism:
            opt.noise = CorrelatedNoise(make_strategy("independent", steps=4), base=opt.noise)
        for step in range(4):
            x = torch.randn(8, 4)
            for p in model.parameters():
                p.grad_sample = torch.randn(8, *p.shape)
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))


@pytest.mark.parametrize("kind", ["banded", "blt", "tree"])
def test_prefix_sum_error_matches_the_prediction(kind, tmp_path):
    """Mean squared error of the prefix sums of z over 40 000 coordinates (independent): its
    relative standard deviation is below 1 %, the tolerance is 4 %."""
    n, sigma = 24, 0.8
    strategy = make_strategy(kind, steps=n, bands=3, buffers=2, period=6, cache_dir=tmp_path)
    noise = CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(1)))
    z = torch.stack([step[0] for step in run(noise, n, std=sigma, shapes=[(40000,)])]).double()
    measured = z.cumsum(0).square().sum(0).mean() / n
    assert float(measured) == pytest.approx(sigma ** 2 * strategy.mse, rel=0.04)
    dp_sgd = sigma ** 2 * strategy.mse / strategy.mse_ratio
    assert (float(measured) < dp_sgd) == (kind != "tree")  # tree loses to DP-SGD over 4 epochs of 6 steps


def test_state_dict_resumes_the_same_noise(tmp_path):
    for strategy in strategies(tmp_path):
        noise = CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(5)))
        run(noise, 5)
        saved = copy.deepcopy(noise.state_dict())
        expected = run(noise, 4)
        resumed = CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(99)))
        resumed.load_state_dict(saved)
        got = run(resumed, 4)
        assert all(torch.equal(a, b) for ga, ea in zip(got, expected) for a, b in zip(ga, ea))
        other = [k for k in strategies(tmp_path) if k.kind != strategy.kind][0]
        with pytest.raises(ValueError, match="mechanism"):
            CorrelatedNoise(other).load_state_dict(saved)
        with pytest.raises(ValueError, match="cannot be resumed"):  # a DP-SGD checkpoint
            CorrelatedNoise(strategy).load_state_dict(GaussianNoise(torch.Generator()).state_dict())


def test_a_discarded_step_leaves_the_buffers(tmp_path):
    strategy = strategies(tmp_path)[0]
    noise = CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(5)))
    run(noise, 3)
    state = noise.generator.get_state()
    run(noise, 1)
    noise.discard_step()
    noise.generator.set_state(state)
    again = run(noise, 2)
    reference = CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(5)))
    expected = run(reference, 5)[3:]
    assert all(torch.equal(a, b) for ga, ea in zip(again, expected) for a, b in zip(ga, ea))


def test_blt_refuses_steps_beyond_its_plan(tmp_path):
    strategy = make_strategy("blt", steps=3, buffers=1, period=3, cache_dir=tmp_path)
    noise = CorrelatedNoise(strategy)
    run(noise, 3)
    with pytest.raises(RuntimeError, match="3 steps"):
        run(noise, 1)


def tree_matrix(n):
    """Dense tree aggregation: rows = the dyadic nodes inside [0, n), prefix decomposition."""
    nodes = [(level, m) for level in range(n.bit_length()) for m in range(n >> level)]
    T = torch.zeros(len(nodes), n, dtype=torch.float64)
    for row, (level, m) in enumerate(nodes):
        T[row, m << level:(m + 1) << level] = 1.0
    return nodes, T


def test_tree_noise_gives_the_dyadic_prefix_noise_and_sensitivity(tmp_path):
    n = 11
    strategy = make_strategy("tree", steps=n, period=4)
    nodes, T = tree_matrix(n)
    pattern = [T[:, list(range(g, n, 4))].sum(1).norm() for g in range(4)]
    assert strategy.sensitivity == pytest.approx(float(max(pattern)))
    z = torch.stack([s[0] for s in run(CorrelatedNoise(strategy, GaussianNoise(torch.Generator().manual_seed(2))),
                                       n, shapes=[(1,)])]).reshape(-1).double()
    w = torch.stack([s[0] for s in run(GaussianNoise(torch.Generator().manual_seed(2)), n, std=strategy.sensitivity,
                                       shapes=[(1,)])]).reshape(-1).double()
    # the draw of step t is the node of level trailing_zeros(t + 1) that ends at step t
    prefix = z.cumsum(0)
    for length in range(1, n + 1):
        blocks, start = [], 0
        for level in reversed(range(length.bit_length())):
            if length >> level & 1:
                blocks.append(start + (1 << level) - 1)  # node ends at this step
                start += 1 << level
        assert float(prefix[length - 1]) == pytest.approx(float(sum(w[end] for end in blocks)), abs=1e-5)

"""A statistical oracle for the noise of a step recovered from parameter updates."""

import math

import torch
from scipy import stats


def assert_standard_normal(z: torch.Tensor, what: str) -> None:
    """``z`` (i.i.d. draws, as claimed) is ``N(0, 1)``: Kolmogorov-Smirnov against the normal CDF
    (p > 10⁻⁴) and mean and standard deviation within five standard errors."""
    z = z.double().flatten()
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n), f"{what}: mean {float(z.mean()):.4f} over {n} draws"
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n), f"{what}: std {float(z.std()):.4f} over {n} draws"
    p_value = stats.kstest(z.numpy(), "norm").pvalue
    assert p_value > 1e-4, f"{what}: Kolmogorov-Smirnov p = {p_value:.2e} over {n} draws"


def assert_uncorrelated(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Two streams of ``N(0, 1)`` draws are not the same stream: correlation within five standard errors of 0."""
    a, b = a.double().flatten(), b.double().flatten()
    correlation = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(correlation) < 5 / math.sqrt(a.numel()), f"{what}: correlation {correlation:.4f}"


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters as one detached vector (a copy): before and after a step, their
    difference is the step's update."""
    return torch.cat([p.detach().flatten() for p in model.parameters()])

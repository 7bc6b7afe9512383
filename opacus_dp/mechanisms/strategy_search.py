"""The searches that optimise a strategy ``C``: banded Toeplitz and BLT coefficients.

Both minimise, at a fixed privacy cost, the expected squared error of the prefix sums of the
``n`` steps (:func:`strategy_loss`, see :mod:`~opacus_dp.mechanisms.strategies`). The optimisation
(L-BFGS on float64, autograd, on the log of the loss) takes about a second for ``n = 10⁴``;
it returns the best point it evaluated and backs off where the loss is not finite
(:func:`_minimise`). A result is not trusted for coming from here: it is checked
(:mod:`~opacus_dp.mechanisms.strategy_validation`) before it is used or cached.
"""

import contextlib
import math
from typing import List, Tuple

import torch

from opacus_dp.mechanisms import toeplitz


def blt_column(theta: torch.Tensor, omega: torch.Tensor, n: int) -> torch.Tensor:
    """``c₀ = 1``, ``c_k = Σ_i ω_i θ_iᵏ⁻¹`` for ``k = 1…n−1``."""
    k = torch.arange(max(n - 1, 0), dtype=toeplitz.DTYPE)
    tail = (omega[:, None] * theta[:, None] ** k[None, :]).sum(0)
    return torch.cat([torch.ones(1, dtype=toeplitz.DTYPE), tail])


def sqrt_prefix_column(n: int) -> torch.Tensor:
    """``c_k = binom(2k, k)/4ᵏ``, the Toeplitz square root of the prefix-sum matrix."""
    k = torch.arange(1, n, dtype=toeplitz.DTYPE)
    return torch.cat([torch.ones(1, dtype=toeplitz.DTYPE), torch.cumprod((2 * k - 1) / (2 * k), 0)])


def strategy_loss(c: torch.Tensor, n: int, period: int, momentum: float) -> torch.Tensor:
    """``Δ_period(C)² · ‖A C⁻¹‖_F² / n`` of the Toeplitz ``C`` with first column ``c``: the
    per-coordinate error of the prefix sums (``A`` with ``momentum``) in units of ``(σ·C_clip)²``."""
    return toeplitz.sensitivity(c, n, period) ** 2 * toeplitz.squared_error_sum(c, n, momentum) / n


def strategy_loss_value(c: torch.Tensor, n: int, period: int, momentum: float) -> float:
    """:func:`strategy_loss` as a float, ``+inf`` where it is not finite."""
    with torch.no_grad():
        value = float(strategy_loss(c, n, period, momentum))
    return value if math.isfinite(value) else math.inf


_WALL = 1e4  # log-loss reported at a non-finite point: far above any finite one


def _minimise(parameters: torch.Tensor, loss_of, iterations: int) -> torch.Tensor:
    """L-BFGS (strong Wolfe line search) on ``log loss_of(parameters)``; the best point seen.

    The logarithm keeps the line search's cubic interpolation finite where the loss climbs
    steeply (an unstable ``C⁻¹`` grows like ``ρⁿ``, ``ρ > 1``). A non-finite loss or gradient
    reads as a wall (log-loss :data:`_WALL`, gradient 0), so the line search backs off. Every
    evaluated point is recorded: the one with the least finite loss is returned (the start
    when nothing finite is better), whatever point L-BFGS ends at.
    """
    x = parameters.detach().clone().requires_grad_(True)
    best = {"loss": math.inf, "point": parameters.detach().clone()}
    optimizer = torch.optim.LBFGS([x], lr=1.0, max_iter=iterations, history_size=20,
                                  line_search_fn="strong_wolfe", tolerance_grad=1e-12,
                                  tolerance_change=1e-12)

    def closure():
        optimizer.zero_grad()
        value = loss_of(x)
        loss = float(value.detach())
        if math.isfinite(loss) and loss > 0:
            log_value = value.log()
            log_value.backward()
            if bool(torch.isfinite(x.grad).all()):
                if loss < best["loss"]:
                    best.update(loss=loss, point=x.detach().clone())
                return log_value.detach()
        x.grad = torch.zeros_like(x)
        return torch.tensor(_WALL, dtype=x.dtype)

    with contextlib.suppress(RuntimeError, ArithmeticError):  # a numerical failure keeps the best point so far
        optimizer.step(closure)
    return best["point"]


def _golden_section(f, low: float, high: float, tolerance: float = 1e-10) -> float:
    """A minimiser of ``f`` on ``[low, high]`` by golden-section search (Kiefer 1953): exact
    for a unimodal ``f``, otherwise a local minimum; a non-finite value counts as ``+inf``."""
    ratio = (math.sqrt(5) - 1) / 2

    def value(x: float) -> float:
        y = f(x)
        return y if math.isfinite(y) else math.inf

    a, b = low, high
    x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
    f1, f2 = value(x1), value(x2)
    while b - a > tolerance:
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - ratio * (b - a)
            f1 = value(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + ratio * (b - a)
            f2 = value(x2)
    return x1 if f1 <= f2 else x2


def optimise_banded(n: int, bands: int, momentum: float = 0.0, iterations: int = 200) -> List[float]:
    """Banded Toeplitz ``c`` (``c₀ = 1``, ``bands`` entries) minimising ``‖c‖²‖A C⁻¹‖²_F``.

    ``c`` is parametrised by its reflection coefficients ``k = tanh(u)``
    (:func:`~opacus_dp.mechanisms.toeplitz.from_reflection`): every ``u`` gives a stable
    ``C⁻¹``. In raw coefficients the optimum approaches the unstable region as ``n`` grows
    (two bands: ``c₁ → 1``, and ``C⁻¹`` has entries ``(−c₁)ᵏ``, so an L-BFGS step past
    ``c₁ = 1`` overflows at a few hundred steps). Started at the truncated square root of
    ``A``; with two bands (one free coefficient) a golden-section search on ``c₁ ∈ (−1, 1)``
    runs too, and the better result is kept.
    """
    bands = min(bands, n)
    if bands == 1:
        return [1.0]

    def column(u: torch.Tensor) -> torch.Tensor:
        return toeplitz.from_reflection(torch.tanh(u))

    start = torch.atanh(toeplitz.to_reflection(sqrt_prefix_column(bands)))
    candidates = [column(_minimise(start, lambda u: strategy_loss(column(u), n, n, momentum), iterations))]
    if bands == 2:
        one = torch.ones(1, dtype=toeplitz.DTYPE)
        k = _golden_section(lambda k: strategy_loss_value(torch.cat([one, one * k]), n, n, momentum), -1.0, 1.0)
        candidates.append(torch.cat([one, one * k]))
    best = min(candidates, key=lambda c: strategy_loss_value(c, n, n, momentum))
    return [1.0] + best[1:].tolist()


def _blt_start(n: int, buffers: int, horizon: int, scale: float) -> torch.Tensor:
    """Unconstrained start: ``1/(1 − θ)`` log-spaced up to ``horizon``, ``ω = softplus(scale)``."""
    scales = torch.logspace(0, math.log10(max(horizon, 2)), buffers + 1, dtype=toeplitz.DTYPE)[1:]
    theta0 = (1 - 1 / scales).clamp(1e-6, 1 - 1e-9)
    return torch.cat([torch.logit(theta0), torch.full((buffers,), scale, dtype=toeplitz.DTYPE)])


def optimise_blt(n: int, buffers: int, period: int, momentum: float = 0.0,
                 iterations: int = 300) -> Tuple[List[float], List[float]]:
    """BLT ``(θ, ω)`` with ``buffers`` terms minimising ``Δ_period(C)²‖A C⁻¹‖²_F``;
    ``θ = sigmoid(u)``, ``ω = softplus(v)`` keep ``C ≥ 0`` entrywise (needed by
    :func:`~opacus_dp.mechanisms.toeplitz.sensitivity`).

    ``C⁻¹`` is unstable for part of this domain (its error then overflows): the search
    backs off from there (:func:`_minimise`). It restarts from other starting points while
    the best loss found is not finite or not below that of ``C = I``; the best is returned.
    """
    identity = strategy_loss_value(torch.ones(1, dtype=toeplitz.DTYPE), n, period, momentum)

    def unpack(params: torch.Tensor):
        return torch.sigmoid(params[:buffers]), torch.nn.functional.softplus(params[buffers:])

    def loss_of(params: torch.Tensor) -> torch.Tensor:
        return strategy_loss(blt_column(*unpack(params), n), n, period, momentum)

    best, best_loss = None, math.inf
    for horizon, scale in ((n, -1.0), (n, -3.0), (max(period, 2), -2.0), (n, -6.0)):
        point = _minimise(_blt_start(n, buffers, horizon, scale), loss_of, iterations)
        value = strategy_loss_value(blt_column(*unpack(point), n), n, period, momentum)
        if best is None or value < best_loss:
            best, best_loss = point, value
        if best_loss < identity:
            break
    theta, omega = unpack(best)
    return theta.tolist(), omega.tolist()

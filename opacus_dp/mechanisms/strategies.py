"""Strategy matrices ``C`` of the correlated-noise mechanisms, optimised for a run.

Each strategy is a lower-triangular Toeplitz ``C`` (:mod:`~opacus_dp.mechanisms.toeplitz`),
normalised so that ``c₀ = 1``, chosen to minimise the expected squared error of the prefix
sums of the ``n`` steps at a fixed privacy cost,

    ``loss(C) = Δ(C)² · ‖A C⁻¹‖_F² / n``   (per coordinate, in units of ``(σ·C_clip)²``),

``A`` the prefix-sum workload (optionally with momentum), ``Δ`` the sensitivity that the
mechanism's privacy analysis uses:

* ``banded`` (BandMF; Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization: A
  unified approach to private training"; McKenna 2025, "Scaling up the Banded Matrix
  Factorization Mechanism"): ``c_k = 0`` for ``k ≥ b``; ``Δ`` = the max column norm ``‖c‖``
  (amplified analysis: an example takes part at most once in any ``b`` consecutive steps).
  Here ``C`` is banded *Toeplitz* (``b − 1`` free coefficients), initialised with the square
  root of ``A``, ``c_k = binom(2k, k)/4ᵏ`` (Fichtenberger et al. 2023, "Constant Matters").
* ``tree`` (DP-FTRL tree aggregation, not Toeplitz): :mod:`~opacus_dp.mechanisms.tree`.
* ``blt`` (buffered linear Toeplitz; Dvijotham et al. 2024, "Efficient and Near-Optimal Noise
  Generation for Streaming Differential Privacy"; McMahan et al. 2024, "Hassle-Free
  Multi-Epoch DP Training"): ``c_k = Σ_i ω_i θ_iᵏ⁻¹`` (``k ≥ 1``, ``ω_i > 0``,
  ``0 < θ_i < 1``), so ``C⁻¹`` is applied with ``d`` buffers; ``Δ`` = the sensitivity under
  cyclic participation every ``period`` steps (no amplification).

The optimisation (L-BFGS on float64, autograd) takes seconds for ``n = 10⁴``; results are
cached on disk (:mod:`~opacus_dp.mechanisms.cache`).
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from opacus_dp.mechanisms import cache, toeplitz, tree

KINDS = ("independent", "tree", "banded", "blt")


@dataclass(frozen=True)
class Strategy:
    """An optimised ``C``: ``kind``, ``steps`` ``n``, ``coefficients`` (the first column; for
    ``banded`` the ``b`` bands), ``blt`` = ``(θ, ω)``, ``sensitivity`` ``Δ`` of the analysis,
    ``column_norm`` (max column norm), ``period`` of participation, ``momentum`` of the workload,
    ``mse`` = ``Δ²‖A C⁻¹‖_F²/n`` and ``mse_ratio`` = ``mse`` / (that of DP-SGD, ``C = I``, under
    the same analysis): both at equal σ."""

    kind: str
    steps: int
    coefficients: Tuple[float, ...]
    sensitivity: float
    column_norm: float
    period: int
    momentum: float = 0.0
    blt: Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]] = None
    mse: float = field(default=float("nan"))
    mse_ratio: float = field(default=float("nan"))

    @property
    def bands(self) -> int:
        """Number of non-zero diagonals (``n`` for a full Toeplitz ``C``)."""
        return len(self.coefficients) if self.kind in ("independent", "banded") else self.steps

    def column(self, n: Optional[int] = None) -> torch.Tensor:
        """First column of ``C`` (``n`` coefficients, default the strategy's steps)."""
        n = self.steps if n is None else n
        if self.kind == "tree":
            raise ValueError("tree aggregation is not a Toeplitz strategy (see opacus_dp.mechanisms.tree)")
        if self.kind == "blt":
            return blt_column(*(toeplitz.as_sequence(v) for v in self.blt), n)
        return toeplitz.as_sequence(self.coefficients)[:n]


def blt_column(theta: torch.Tensor, omega: torch.Tensor, n: int) -> torch.Tensor:
    """``c₀ = 1``, ``c_k = Σ_i ω_i θ_iᵏ⁻¹`` for ``k = 1…n−1``."""
    k = torch.arange(max(n - 1, 0), dtype=toeplitz.DTYPE)
    tail = (omega[:, None] * theta[:, None] ** k[None, :]).sum(0)
    return torch.cat([torch.ones(1, dtype=toeplitz.DTYPE), tail])


def sqrt_prefix_column(n: int) -> torch.Tensor:
    """``c_k = binom(2k, k)/4ᵏ``, the Toeplitz square root of the prefix-sum matrix."""
    k = torch.arange(1, n, dtype=toeplitz.DTYPE)
    return torch.cat([torch.ones(1, dtype=toeplitz.DTYPE), torch.cumprod((2 * k - 1) / (2 * k), 0)])


def _loss(c: torch.Tensor, n: int, period: int, momentum: float) -> torch.Tensor:
    return toeplitz.sensitivity(c, n, period) ** 2 * toeplitz.squared_error_sum(c, n, momentum) / n


def _minimise(parameters: torch.Tensor, loss_of, iterations: int) -> torch.Tensor:
    """L-BFGS (strong Wolfe line search) on ``loss_of(parameters)``; the best point seen."""
    parameters = parameters.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([parameters], lr=1.0, max_iter=iterations, history_size=20,
                                  line_search_fn="strong_wolfe", tolerance_grad=1e-12,
                                  tolerance_change=1e-14)

    def closure():
        optimizer.zero_grad()
        value = loss_of(parameters)
        value.backward()
        return value

    optimizer.step(closure)
    return parameters.detach()


def optimise_banded(n: int, bands: int, momentum: float = 0.0, iterations: int = 200) -> List[float]:
    """Banded Toeplitz ``c`` (``c₀ = 1``, ``bands`` entries) minimising ``‖c‖²‖A C⁻¹‖²_F``."""
    bands = min(bands, n)
    start = sqrt_prefix_column(bands)
    if bands == 1:
        return [1.0]
    one = torch.ones(1, dtype=toeplitz.DTYPE)
    tail = _minimise(start[1:], lambda t: _loss(torch.cat([one, t]), n, n, momentum), iterations)
    return [1.0] + tail.tolist()


def optimise_blt(n: int, buffers: int, period: int, momentum: float = 0.0,
                 iterations: int = 300) -> Tuple[List[float], List[float]]:
    """BLT ``(θ, ω)`` with ``buffers`` terms minimising ``Δ_period(C)²‖A C⁻¹‖²_F``;
    ``θ = sigmoid(u)``, ``ω = softplus(v)`` keep ``C ≥ 0`` entrywise (needed by
    :func:`~opacus_dp.mechanisms.toeplitz.sensitivity`)."""
    scales = torch.logspace(0, math.log10(max(n, 2)), buffers + 1, dtype=toeplitz.DTYPE)[1:]
    theta0 = 1 - 1 / scales
    start = torch.cat([torch.logit(theta0), torch.full((buffers,), -1.0, dtype=toeplitz.DTYPE)])

    def loss_of(params: torch.Tensor) -> torch.Tensor:
        theta, omega = torch.sigmoid(params[:buffers]), torch.nn.functional.softplus(params[buffers:])
        return _loss(blt_column(theta, omega, n), n, period, momentum)

    best = _minimise(start, loss_of, iterations)
    theta, omega = torch.sigmoid(best[:buffers]), torch.nn.functional.softplus(best[buffers:])
    return theta.tolist(), omega.tolist()


def _finish(kind: str, n: int, period: int, momentum: float, coefficients, blt=None) -> Strategy:
    """The :class:`Strategy` with its sensitivity and predicted errors."""
    draft = Strategy(kind, n, tuple(coefficients), 1.0, 1.0, period, momentum, blt)
    c = draft.column()
    column_norm = float(toeplitz.sensitivity(c, n, n))
    sens = float(toeplitz.sensitivity(c, n, period))
    mse = sens ** 2 * float(toeplitz.squared_error_sum(c, n, momentum)) / n
    identity = float(_loss(torch.ones(1, dtype=toeplitz.DTYPE), n, period, momentum))
    return Strategy(kind, n, tuple(coefficients), sens, column_norm, period, momentum, blt,
                    mse=mse, mse_ratio=mse / identity)


def make_strategy(kind: str, *, steps: int, bands: Optional[int] = None, buffers: int = 4,
                  period: Optional[int] = None, momentum: float = 0.0,
                  cache_dir: Optional[str] = None) -> Strategy:
    """The optimised strategy of ``kind`` for ``steps`` steps (cached, see module doc).

    ``independent``: ``C = I``. ``banded``: ``bands`` ``b`` (amplified analysis, participation
    at most once per ``b`` steps). ``blt``: ``buffers`` ``d``, participation every ``period``
    steps (default: once in the run)."""
    if kind not in KINDS:
        raise ValueError(f"noise mechanism must be one of {KINDS}, got {kind!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
    if kind == "independent":
        return _finish(kind, steps, period or steps, momentum, [1.0])
    if kind == "tree":
        return _tree_strategy(steps, min(period or steps, steps), momentum)
    if kind == "banded":
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ValueError(f"noise_mechanism='banded' needs bands, a positive int; got {bands!r}")
        key = {"kind": kind, "steps": steps, "bands": min(bands, steps), "momentum": momentum}
        found = cache.load(key, cache_dir)
        coefficients = found["c"] if found else optimise_banded(steps, bands, momentum)
        cache.store(key, {"c": coefficients}, cache_dir)
        return _finish(kind, steps, steps, momentum, coefficients)
    period = min(period or steps, steps)
    key = {"kind": kind, "steps": steps, "buffers": buffers, "period": period, "momentum": momentum}
    found = cache.load(key, cache_dir)
    theta, omega = (found["theta"], found["omega"]) if found else optimise_blt(steps, buffers, period, momentum)
    cache.store(key, {"theta": theta, "omega": omega}, cache_dir)
    return _finish(kind, steps, period, momentum, [1.0], blt=(tuple(theta), tuple(omega)))


def _tree_strategy(n: int, period: int, momentum: float) -> Strategy:
    """Tree aggregation's sensitivity and predicted error (prefix sums only)."""
    if momentum:
        raise ValueError("noise_mechanism='tree' predicts the error of plain prefix sums: momentum must be 0")
    sens = tree.sensitivity(n, period)
    mse = sens ** 2 * tree.mean_nodes(n)
    identity = float(_loss(torch.ones(1, dtype=toeplitz.DTYPE), n, period, 0.0))
    return Strategy("tree", n, (1.0,), sens, tree.sensitivity(n, n), period, mse=mse, mse_ratio=mse / identity)

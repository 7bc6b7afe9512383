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

The optimisation (L-BFGS on float64, autograd, on the log of the loss) takes about a second
for ``n = 10⁴``; it returns the best point it evaluated and backs off where the loss is not
finite (:func:`_minimise`). Every strategy, optimised or read from the on-disk cache
(:mod:`~opacus_dp.mechanisms.cache`), is checked by :func:`defect` before it is used or
cached: finite, of the configured shape, ``C ≥ 0`` for BLT, ``Δ > 0`` and never worse than
``C = I``; otherwise ``C = I`` is used with a warning, or :class:`StrategyError` raised.
"""

import contextlib
import enum
import math
import warnings
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


def _loss_value(c: torch.Tensor, n: int, period: int, momentum: float) -> float:
    """:func:`_loss` as a float, ``+inf`` where it is not finite."""
    with torch.no_grad():
        value = float(_loss(c, n, period, momentum))
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
    candidates = [column(_minimise(start, lambda u: _loss(column(u), n, n, momentum), iterations))]
    if bands == 2:
        one = torch.ones(1, dtype=toeplitz.DTYPE)
        k = _golden_section(lambda k: _loss_value(torch.cat([one, one * k]), n, n, momentum), -1.0, 1.0)
        candidates.append(torch.cat([one, one * k]))
    best = min(candidates, key=lambda c: _loss_value(c, n, n, momentum))
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
    identity = _loss_value(torch.ones(1, dtype=toeplitz.DTYPE), n, period, momentum)

    def unpack(params: torch.Tensor):
        return torch.sigmoid(params[:buffers]), torch.nn.functional.softplus(params[buffers:])

    def loss_of(params: torch.Tensor) -> torch.Tensor:
        return _loss(blt_column(*unpack(params), n), n, period, momentum)

    best, best_loss = None, math.inf
    for horizon, scale in ((n, -1.0), (n, -3.0), (max(period, 2), -2.0), (n, -6.0)):
        point = _minimise(_blt_start(n, buffers, horizon, scale), loss_of, iterations)
        value = _loss_value(blt_column(*unpack(point), n), n, period, momentum)
        if best is None or value < best_loss:
            best, best_loss = point, value
        if best_loss < identity:
            break
    theta, omega = unpack(best)
    return theta.tolist(), omega.tolist()


class Defect(enum.Enum):
    """Why a strategy is refused (:func:`defect`)."""

    NOT_FINITE = "a coefficient, its sensitivity or its error is not finite"
    SHAPE = "its coefficients do not fit the configuration"
    NOT_NONNEGATIVE = "BLT needs 0 ≤ θ < 1 and ω ≥ 0 (C ≥ 0): the sensitivity formula assumes it"
    SENSITIVITY = "its sensitivity is not positive"
    WORSE_THAN_IDENTITY = "its error exceeds that of C = I (DP-SGD noise under the same analysis)"


class StrategyError(ValueError):
    """No valid strategy for a configuration; ``defect`` says why."""

    def __init__(self, message: str, defect: "Defect"):
        super().__init__(message)
        self.defect = defect


def defect(strategy: Strategy, bands: Optional[int] = None, buffers: Optional[int] = None,
           tolerance: float = 1e-6) -> Optional[Defect]:
    """The first reason to refuse ``strategy``, or None: every coefficient, ``Δ``, the column
    norm and ``mse`` finite; ``c₀ = 1`` and ``bands`` (banded) or ``buffers`` (BLT) entries;
    BLT ``0 ≤ θ < 1``, ``ω ≥ 0``; ``Δ > 0``; and, except for tree aggregation (a fixed
    mechanism, not optimised), ``mse_ratio ≤ 1 + tolerance``: never worse than ``C = I``."""
    numbers = list(strategy.coefficients) + [strategy.sensitivity, strategy.column_norm, strategy.mse,
                                             strategy.mse_ratio]
    theta, omega = strategy.blt if strategy.blt is not None else ((), ())
    if not all(math.isfinite(x) for x in numbers + list(theta) + list(omega)):
        return Defect.NOT_FINITE
    if strategy.coefficients[0] != 1.0 or (bands is not None and len(strategy.coefficients) != bands) or (
            buffers is not None and not len(theta) == len(omega) == buffers):
        return Defect.SHAPE
    if not all(0 <= t < 1 for t in theta) or not all(w >= 0 for w in omega):
        return Defect.NOT_NONNEGATIVE
    if not (strategy.sensitivity > 0 and strategy.column_norm > 0):
        return Defect.SENSITIVITY
    if strategy.kind != "tree" and not strategy.mse_ratio <= 1 + tolerance:
        return Defect.WORSE_THAN_IDENTITY
    return None


def _checked(build, value, check) -> Tuple[Optional[Strategy], Optional[Defect]]:
    try:
        strategy = build(value)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError):
        return None, Defect.SHAPE
    return strategy, check(strategy)


def _settled(key: dict, cache_dir, build, optimise, identity, check) -> Strategy:
    """The strategy of ``key``: the cached value if its strategy passes ``check``; else the
    optimised one (then cached); else ``C = I`` (``identity``) with a warning; else
    :class:`StrategyError`. ``build`` turns a value (a dict of lists) into a strategy."""
    found = cache.load(key, cache_dir)
    if found is not None:
        strategy, problem = _checked(build, found, check)
        if problem is None:
            return strategy
    value = optimise()
    strategy, problem = _checked(build, value, check)
    if problem is None:
        cache.store(key, value, cache_dir)
        return strategy
    where = "make_strategy(" + ", ".join(f"{k}={v!r}" for k, v in key.items() if k != "kind") + ")"
    fallback, fallback_problem = _checked(build, identity, check)
    if fallback_problem is not None:
        raise StrategyError(f"{where}: no valid {key['kind']} strategy ({problem.value}; C = I: "
                            f"{fallback_problem.value}); use noise_mechanism='independent'", problem)
    warnings.warn(f"{where}: the optimised {key['kind']} strategy was refused ({problem.value}); using "
                  "C = I, DP-SGD's noise under the same analysis. Other steps, bands or buffers may "
                  "optimise well.", RuntimeWarning, stacklevel=3)
    return fallback


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
        bands = min(bands, steps)
        return _settled({"kind": kind, "steps": steps, "bands": bands, "momentum": momentum}, cache_dir,
                        build=lambda v: _finish(kind, steps, steps, momentum, v["c"]),
                        optimise=lambda: {"c": optimise_banded(steps, bands, momentum)},
                        identity={"c": [1.0] + [0.0] * (bands - 1)},
                        check=lambda s: defect(s, bands=bands))
    period = min(period or steps, steps)
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise ValueError(f"noise_mechanism='blt' needs buffers, a positive int; got {buffers!r}")

    def optimise() -> dict:
        theta, omega = optimise_blt(steps, buffers, period, momentum)
        return {"theta": theta, "omega": omega}

    return _settled({"kind": kind, "steps": steps, "buffers": buffers, "period": period, "momentum": momentum},
                    cache_dir, build=lambda v: _finish(kind, steps, period, momentum, [1.0],
                                                       blt=(tuple(v["theta"]), tuple(v["omega"]))),
                    optimise=optimise, identity={"theta": [0.0] * buffers, "omega": [0.0] * buffers},
                    check=lambda s: defect(s, buffers=buffers))


def _tree_strategy(n: int, period: int, momentum: float) -> Strategy:
    """Tree aggregation's sensitivity and predicted error (prefix sums only)."""
    if momentum:
        raise ValueError("noise_mechanism='tree' predicts the error of plain prefix sums: momentum must be 0")
    sens = tree.sensitivity(n, period)
    mse = sens ** 2 * tree.mean_nodes(n)
    identity = float(_loss(torch.ones(1, dtype=toeplitz.DTYPE), n, period, 0.0))
    return Strategy("tree", n, (1.0,), sens, tree.sensitivity(n, n), period, mse=mse, mse_ratio=mse / identity)

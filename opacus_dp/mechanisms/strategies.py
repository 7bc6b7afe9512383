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

The optimisation is in :mod:`~opacus_dp.mechanisms.strategy_search`. Every strategy, optimised
or read from the on-disk cache (:mod:`~opacus_dp.mechanisms.cache`), is checked before it is
used or cached (:mod:`~opacus_dp.mechanisms.strategy_validation`); otherwise ``C = I`` is used
with a warning, or :class:`~opacus_dp.mechanisms.strategy_validation.StrategyError` raised.
"""

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from opacus_dp.mechanisms import strategy_search, strategy_validation, toeplitz, tree


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
            return strategy_search.blt_column(*(toeplitz.as_sequence(v) for v in self.blt), n)
        return toeplitz.as_sequence(self.coefficients)[:n]


def _identity_loss(n: int, period: int, momentum: float) -> float:
    """The loss of ``C = I`` (DP-SGD) under the same analysis."""
    return float(strategy_search.strategy_loss(torch.ones(1, dtype=toeplitz.DTYPE), n, period, momentum))


def _finish(kind: str, n: int, period: int, momentum: float, coefficients, blt=None) -> Strategy:
    """The :class:`Strategy` with its sensitivity and predicted errors."""
    draft = Strategy(kind, n, tuple(coefficients), 1.0, 1.0, period, momentum, blt)
    c = draft.column()
    column_norm = float(toeplitz.sensitivity(c, n, n))
    sens = float(toeplitz.sensitivity(c, n, period))
    mse = sens ** 2 * float(toeplitz.squared_error_sum(c, n, momentum)) / n
    identity = _identity_loss(n, period, momentum)
    return Strategy(kind, n, tuple(coefficients), sens, column_norm, period, momentum, blt,
                    mse=mse, mse_ratio=mse / identity)


def _independent_strategy(steps: int, period: Optional[int], momentum: float, **_unused) -> Strategy:
    """``C = I``, DP-SGD."""
    return _finish("independent", steps, period or steps, momentum, [1.0])


def _tree_strategy(steps: int, period: Optional[int], momentum: float, **_unused) -> Strategy:
    """Tree aggregation's sensitivity and predicted error (prefix sums only)."""
    if momentum:
        raise ValueError("noise_mechanism='tree' predicts the error of plain prefix sums: momentum must be 0")
    period = min(period or steps, steps)
    sens = tree.sensitivity(steps, period)
    mse = sens ** 2 * tree.mean_nodes(steps)
    identity = _identity_loss(steps, period, 0.0)
    return Strategy("tree", steps, (1.0,), sens, tree.sensitivity(steps, steps), period, mse=mse,
                    mse_ratio=mse / identity)


def _banded_strategy(steps: int, period: Optional[int], momentum: float, *, bands, cache_dir,
                     **_unused) -> Strategy:
    """BandMF with ``bands`` bands (amplified analysis: ``period`` is not used)."""
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ValueError(f"noise_mechanism='banded' needs bands, a positive int; got {bands!r}")
    bands = min(bands, steps)
    key = {"kind": "banded", "steps": steps, "bands": bands, "momentum": momentum}
    return strategy_validation.settled(
        key, cache_dir, build=lambda v: _finish("banded", steps, steps, momentum, v["c"]),
        optimise=lambda: {"c": strategy_search.optimise_banded(steps, bands, momentum)},
        identity={"c": [1.0] + [0.0] * (bands - 1)},
        check=lambda s: strategy_validation.defect(s, bands=bands))


def _blt_strategy(steps: int, period: Optional[int], momentum: float, *, buffers, cache_dir,
                  **_unused) -> Strategy:
    """BLT with ``buffers`` buffers, participation every ``period`` steps."""
    period = min(period or steps, steps)
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise ValueError(f"noise_mechanism='blt' needs buffers, a positive int; got {buffers!r}")

    def optimise() -> dict:
        theta, omega = strategy_search.optimise_blt(steps, buffers, period, momentum)
        return {"theta": theta, "omega": omega}

    key = {"kind": "blt", "steps": steps, "buffers": buffers, "period": period, "momentum": momentum}
    return strategy_validation.settled(
        key, cache_dir, build=lambda v: _finish("blt", steps, period, momentum, [1.0],
                                                blt=(tuple(v["theta"]), tuple(v["omega"]))),
        optimise=optimise, identity={"theta": [0.0] * buffers, "omega": [0.0] * buffers},
        check=lambda s: strategy_validation.defect(s, buffers=buffers))


_BUILDERS = {"independent": _independent_strategy, "tree": _tree_strategy, "banded": _banded_strategy,
             "blt": _blt_strategy}
KINDS = tuple(_BUILDERS)  # ("independent", "tree", "banded", "blt")


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
    return _BUILDERS[kind](steps, period, momentum, bands=bands, buffers=buffers, cache_dir=cache_dir)

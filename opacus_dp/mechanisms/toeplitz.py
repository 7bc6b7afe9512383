"""Lower-triangular Toeplitz matrices as coefficient sequences (float64 torch tensors).

A lower-triangular Toeplitz ``n×n`` matrix ``M`` with ``M[i, j] = m[i − j]`` (``i ≥ j``) is
stored as its first column ``m``. Products of such matrices are again Toeplitz, with the
truncated convolution of the sequences; the inverse has the power-series inverse
``1/m(x) mod xⁿ``. All functions are differentiable (strategy optimisation uses autograd).

Matrix mechanism (Li et al. 2015; Denisov et al. 2022, "Improved Differential Privacy for SGD
via Optimal Private Linear Operators on Adaptive Streams"): to release the prefix sums
``A x`` of the gradients ``x``, factor ``A = B C``, privatise ``C x + w`` with
``w ~ N(0, σ²Δ²I)`` and release ``B (C x + w) = A x + A C⁻¹ w``; in DP-SGD form each step gets
the noise ``z = C⁻¹ w``. Per coordinate the mean squared error of the ``n`` prefix sums is
``σ²Δ² ‖A C⁻¹‖_F² / n``, where ``Δ`` is the sensitivity of ``x ↦ C x``.
"""

import math

import torch

DTYPE = torch.float64


def as_sequence(values) -> torch.Tensor:
    """``values`` as a 1-D float64 tensor."""
    return torch.as_tensor(values, dtype=DTYPE).reshape(-1)


def truncated_convolution(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """First ``n`` coefficients of ``a(x)·b(x)`` (the product of the two Toeplitz matrices)."""
    size = 1 << max(1, (len(a) + len(b) - 1).bit_length())
    product = torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)
    out = product[:n]
    return out if len(out) == n else torch.cat([out, out.new_zeros(n - len(out))])


def series_inverse(c: torch.Tensor, n: int) -> torch.Tensor:
    """First ``n`` coefficients of ``1/c(x)`` (``c[0] ≠ 0``): the first column of ``C⁻¹``.

    Newton's iteration ``h ← h·(2 − c·h) mod x^{2m}`` doubles the number of correct
    coefficients per round (Sieveking 1972, Kung 1974), with FFT products: ``O(n log n)``.
    """
    h = (1.0 / c[:1]).reshape(1)
    m = 1
    while m < n:
        m = min(2 * m, n)
        two = torch.zeros(m, dtype=DTYPE)
        two[0] = 2.0
        h = truncated_convolution(h, two - truncated_convolution(c[:m], h, m), m)
    return h[:n]


def prefix_workload(n: int, momentum: float = 0.0) -> torch.Tensor:
    """First column of the workload ``A``: prefix sums (``a_k = 1``), or with heavy-ball momentum
    ``β`` the parameter change of SGD with momentum, ``a_k = Σ_{j≤k} βʲ = (1 − β^{k+1})/(1 − β)``
    (Denisov et al. 2022, §5)."""
    k = torch.arange(n, dtype=DTYPE)
    if momentum == 0:
        return torch.ones(n, dtype=DTYPE)
    return (1 - momentum ** (k + 1)) / (1 - momentum)


def squared_error_sum(c: torch.Tensor, n: int, momentum: float = 0.0) -> torch.Tensor:
    """``‖A C⁻¹‖_F²`` for Toeplitz ``C`` (first column ``c``): ``Σ_k (n − k) g_k²`` with
    ``g = a · c⁻¹`` (a Toeplitz matrix has ``n − k`` entries equal to ``g_k``)."""
    g = truncated_convolution(prefix_workload(n, momentum), series_inverse(c, n), n)
    weights = torch.arange(n, 0, -1, dtype=DTYPE)
    return (weights * g * g).sum()


def participation_sum(c: torch.Tensor, n: int, period: int) -> torch.Tensor:
    """``w = Σ_m (column m·period of C)``, the first ``n`` entries: one example's summed
    columns when it takes part in steps ``0, p, 2p, …`` (``w_t = Σ_{mp ≤ t} c_{t − mp}``)."""
    c = torch.cat([c[:n], c.new_zeros(max(0, n - len(c)))])
    rounds = math.ceil(n / period)
    padded = torch.cat([c, c.new_zeros(rounds * period - n)]).reshape(rounds, period)
    return padded.cumsum(0).reshape(-1)[:n]


def sensitivity(c: torch.Tensor, n: int, period: int) -> torch.Tensor:
    """L2 sensitivity of ``x ↦ C x`` for an example that takes part (at most) every ``period``
    steps, a fixed residue class (cyclic participation), when all entries of ``C`` are ≥ 0.

    Then ``CᵀC ≥ 0`` entrywise, so taking part in more of its steps never lowers the norm and
    the worst case is all of them: ``max_g ‖Σ_m C[:, g + m·p]‖``. For Toeplitz ``C`` this
    vector for residue ``g`` is that of residue 0 shifted down by ``g`` and truncated, so the
    maximum is at ``g = 0`` (Choquette-Choo et al. 2023, "Multi-Epoch Matrix Factorization
    Mechanisms for Private Machine Learning", §3). ``period ≥ n``: the max column norm ``‖c‖``
    (for any signs).
    """
    return participation_sum(c, n, min(period, n)).square().sum().sqrt()


def dense(c: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n×n`` matrix (for tests and small ``n``)."""
    c = torch.cat([c[:n], c.new_zeros(max(0, n - len(c)))])
    i = torch.arange(n)
    diff = i[:, None] - i[None, :]
    return torch.where(diff >= 0, c[diff.clamp(min=0)], c.new_zeros(()))


def from_reflection(k: torch.Tensor) -> torch.Tensor:
    """Coefficients ``c`` (``c₀ = 1``, ``len(k) + 1`` entries) of the polynomial with reflection
    coefficients ``k`` (Levinson step-up: ``c ← [c, 0] + k_j·reverse([c, 0])``).

    ``|k_j| < 1`` for all ``j`` if and only if every root of ``c(x)`` lies outside the unit
    disk (the Schur–Cohn test; e.g. Hayes 1996, "Statistical Digital Signal Processing and
    Modeling", §5.2), so ``1/c(x)`` has bounded, decaying coefficients: ``C⁻¹`` is stable
    for every ``n`` and a banded strategy parametrised by ``k = tanh(u)`` cannot make the
    error overflow.
    """
    c = k.new_ones(1)
    for value in k:
        padded = torch.cat([c, k.new_zeros(1)])
        c = padded + value * padded.flip(0)
    return c


def to_reflection(c) -> torch.Tensor:
    """The reflection coefficients of ``c`` (``c₀ = 1``; Levinson step-down, the inverse of
    :func:`from_reflection`); ``|k_j| ≥ 1`` (a root of ``c(x)`` in the closed unit disk)
    raises ``ValueError``."""
    c = as_sequence(c).tolist()
    found = []
    while len(c) > 1:
        k = c[-1]
        if not abs(k) < 1:
            raise ValueError(f"c(x) has a root in the closed unit disk (reflection coefficient {k})")
        found.append(k)
        c = [(c[i] - k * c[-1 - i]) / (1 - k * k) for i in range(len(c) - 1)]
    return as_sequence(found[::-1])

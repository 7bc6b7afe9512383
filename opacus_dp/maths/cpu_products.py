"""Which library multiplies the clipped sums', the ghost norms' and the per-sample gradients'
matrices on CPU: torch's BLAS or oneDNN.

The clipped sum of a ``Linear`` layer in the norms-only modes is one matrix product of the
weight's size, ``(f ⊙ G)ᵀ A`` over the batch's ``B·T`` rows; its ghost norm takes, per sample,
the Gram products ``A_i A_iᵀ`` and ``G_i G_iᵀ`` (:func:`per_sample_products`). torch multiplies float32 matrices
on CPU with its BLAS (MKL in the official x86 wheels), which on AMD CPUs with AVX-512 runs its
AVX2 kernels; oneDNN, which torch ships for its convolutions, uses the CPU's widest vector
instructions. Where oneDNN forms a product, it does so only where the product is large (at least
``MIN_MULTIPLY_ADDS`` multiply-adds: below that its fixed cost per call outweighs the gain) and
sums at least ``MIN_INNER`` rows (``B·T``) into each entry, unless its result is small enough
for glibc's settled heap to keep (:mod:`~opacus_dp.maths.heap_threshold`; otherwise the page
faults of writing a freshly mapped result outweigh the gain of a product over fewer rows). The model's own forward and backward
passes are not touched.

The setting (``set_cpu_products`` or the environment variable ``OPACUS_DP_CPU_PRODUCTS``, read
once, when a norms-only wrapper is built or at the first product):

* ``"auto"`` (default): ``"onednn"`` on a CPU where torch's BLAS is MKL and the CPU is an AMD one
  with AVX-512 (read from ``/proc/cpuinfo``; Linux), ``"torch"`` everywhere else;
* ``"torch"``: torch's BLAS for every product;
* ``"onednn"``: oneDNN for the large products on any CPU (refused where torch has none).

Both libraries compute IEEE float32 products (inside
:func:`~opacus_dp.maths.float32_products.ieee_float32_products`, whatever reduced precision
the user allowed), summing in different orders: the sums agree to float32 rounding, not bit for
bit, so a run is reproducible with either setting but not across them (``"torch"`` gives the
bits of earlier releases). The noise, clipping bound and accounting are the same with either.

Per-sample products (the Gram products' row blocks, ``(B, r, d) × (B, d, c)``) are one call per
sample where oneDNN forms them, since it has no batched product in torch: on one and two threads
of an AVX-512 AMD CPU, 0.52–0.82 × the time of ``torch.bmm`` from ``2²¹`` multiply-adds per sample
and thread on (rows of 64, ``T`` = 128–512, ``d`` = 256–1024), slower below (up to 3 × at
``2¹⁹``; ``bmm`` parallelises over the samples, one product over its own rows). So oneDNN takes a
per-sample product of at least ``MIN_SAMPLE_MULTIPLY_ADDS_PER_THREAD`` multiply-adds per thread
(``torch.get_num_threads()``): with ``"onednn"`` the bits of a run's norms depend on its thread
count where a layer's products lie between the thresholds of the two counts. The same holds for
the per-sample gradients of ``Linear`` layers (:func:`outer_sums`, ``G_iᵀ A_i``, which copies each
sample's ``G_iᵀ`` contiguous for oneDNN): 0.49–0.72 × bmm's time on one thread from ``2²²``
multiply-adds per sample, 0.54–0.86 × on two threads from ``2²³`` (``T`` = 16–128, 64–1024
features), slower below (1.05 × at ``2²¹`` on one thread, 1.13–1.77 × at ``2²¹``–``2²²`` on
two): ``MIN_OUTER_SUM_MULTIPLY_ADDS_PER_THREAD``.
"""

import os
from contextlib import contextmanager
from typing import Iterator, Optional, Set, Tuple

import torch

from opacus_dp.maths.heap_threshold import keeps_blocks_of
from opacus_dp.maths.huge_pages import batched_outer_sums, empty_on_huge_pages

BACKENDS = ("torch", "onednn")
SETTINGS = ("auto",) + BACKENDS
ENVIRONMENT_VARIABLE = "OPACUS_DP_CPU_PRODUCTS"
MIN_MULTIPLY_ADDS = 1 << 24
# oneDNN allocates its result itself, where it cannot be advised to huge pages as torch's path
# is (huge_pages.py): writing a freshly mapped result faults every 4 KiB page, a cost per entry
# that a product of few rows per entry (a small batch of a wide layer) does not recoup; 256 rows
# and up do on the CPUs measured (docs/benchmarks.md). A result that glibc's settled heap keeps
# (heap_threshold.py) is not mapped afresh: any number of rows then gains.
MIN_INNER = 256
MIN_SAMPLE_MULTIPLY_ADDS_PER_THREAD = 1 << 21  # per-sample products by oneDNN (module doc)
MIN_OUTER_SUM_MULTIPLY_ADDS_PER_THREAD = 1 << 22  # per-sample gradients by oneDNN (module doc)
_backend: Optional[str] = None  # None until set or read from the environment
_onednn_works: Optional[bool] = None


def _onednn_linear(left: torch.Tensor, right_t: torch.Tensor) -> torch.Tensor:
    """``left @ right_tᵀ`` by oneDNN's float32 matrix product (torch's own binding of it)."""
    return torch.ops.mkldnn._linear_pointwise(left, right_t, None, "none", [], "")


def _onednn_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` by oneDNN, in the orientation that copies the fewest values.

    oneDNN's product takes its second operand in any layout but copies a first operand that is
    not contiguous (a transposed view such as ``Gᵀ`` of a clipped sum: its whole size). So it
    forms either ``left @ right`` (copying ``left`` if needed: ``m·k``) or ``(rightᵀ @ leftᵀ)ᵀ``
    (copying ``rightᵀ`` if needed, ``n·k``, and transposing the ``m·n`` result), whichever copies
    less."""
    (m, k), n = left.shape, right.shape[1]
    as_given = 0 if left.is_contiguous() else m * k
    transposed = (0 if right.t().is_contiguous() else n * k) + m * n
    if as_given <= transposed:
        return _onednn_linear(left, right.t())
    return _onednn_linear(right.t(), left).t().contiguous()


def onednn_available() -> bool:
    """True if this torch has oneDNN's product and it agrees with ``torch.mm`` on a small case
    (checked once per process)."""
    global _onednn_works
    if _onednn_works is None:
        _onednn_works = _onednn_agrees_with_torch()
    return _onednn_works


def _onednn_agrees_with_torch() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    values = torch.linspace(-1, 1, 35, dtype=torch.float64).sin()  # fixed, not from the global RNG
    left, right = values[:15].view(3, 5), values[15:].view(5, 4)
    try:
        found = _onednn_linear(left.float(), right.float().t())
    except RuntimeError:  # the op exists but refuses plain float32 tensors in this build
        return False
    return bool(torch.allclose(found.double(), left @ right, rtol=1e-4, atol=1e-5))


def _cpu_flags_and_vendor() -> Tuple[Set[str], str]:
    """The first CPU's feature flags and vendor from ``/proc/cpuinfo`` (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            first_cpu = cpuinfo.read().split("\n\n")[0]
    except OSError:  # not Linux, or /proc hidden: nothing known
        return set(), ""
    pairs = (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    return set(fields.get("flags", "").split()), fields.get("vendor_id", "")


def blas_runs_narrower_than_the_cpu() -> bool:
    """True where torch's BLAS is MKL on an AMD CPU with AVX-512: MKL runs its AVX2 kernels there."""
    flags, vendor = _cpu_flags_and_vendor()
    return torch.backends.mkl.is_available() and vendor == "AuthenticAMD" and "avx512f" in flags


def automatic_backend() -> str:
    """What ``"auto"`` chooses: ``"onednn"`` where :func:`blas_runs_narrower_than_the_cpu` and
    oneDNN's product works, else ``"torch"``."""
    return "onednn" if blas_runs_narrower_than_the_cpu() and onednn_available() else "torch"


def set_cpu_products(backend: str) -> None:
    """Form the large clipped-sum products on CPU with ``"torch"`` (its BLAS), ``"onednn"``, or
    ``"auto"`` (:func:`automatic_backend`: oneDNN where MKL runs narrower code than the CPU has)."""
    global _backend
    if backend not in SETTINGS:
        raise ValueError(f"set_cpu_products: backend must be one of {SETTINGS}, got {backend!r}")
    if backend == "auto":
        backend = automatic_backend()
    if backend == "onednn" and not onednn_available():
        raise RuntimeError(
            "set_cpu_products('onednn'): this torch build has no usable oneDNN float32 product "
            "(torch.backends.mkldnn unavailable, or torch.ops.mkldnn._linear_pointwise missing or "
            f"wrong); use 'torch' (and unset {ENVIRONMENT_VARIABLE})")
    _backend = backend


def cpu_products() -> str:
    """The backend in effect (``"torch"`` or ``"onednn"``); the first call reads
    ``OPACUS_DP_CPU_PRODUCTS`` (default ``"auto"``)."""
    if _backend is None:
        value = os.environ.get(ENVIRONMENT_VARIABLE, "auto")
        if value not in SETTINGS:
            raise ValueError(f"environment variable {ENVIRONMENT_VARIABLE}={value!r}: must be one of {SETTINGS}")
        set_cpu_products(value)
    return _backend


@contextmanager
def cpu_products_set_to(backend: str) -> Iterator[None]:
    """:func:`set_cpu_products` ``(backend)`` inside the block, the previous setting after it."""
    global _backend
    previous = _backend
    set_cpu_products(backend)
    try:
        yield
    finally:
        _backend = previous


def routes_to_onednn(left: torch.Tensor, right: torch.Tensor) -> bool:
    """True if ``left @ right`` (2-D) is formed by oneDNN: CPU float32 operands of at least
    ``MIN_MULTIPLY_ADDS`` multiply-adds summing at least ``MIN_INNER`` terms per entry, or fewer
    into a result the settled heap keeps (:func:`~opacus_dp.maths.heap_threshold.keeps_blocks_of`),
    with the ``"onednn"`` backend set."""
    result_bytes = left.shape[0] * right.shape[1] * 4
    return (left.device.type == "cpu" and left.dtype == torch.float32 == right.dtype
            and (left.shape[1] >= MIN_INNER or keeps_blocks_of(result_bytes))
            and left.shape[0] * left.shape[1] * right.shape[1] >= MIN_MULTIPLY_ADDS
            and cpu_products() == "onednn")


def matrix_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` (2-D) into a new tensor: by oneDNN where :func:`routes_to_onednn`, else by
    ``torch.mm`` into a tensor advised to huge pages (a weight-sized sum: few page faults)."""
    if routes_to_onednn(left, right):
        return _onednn_product(left, right)
    out = empty_on_huge_pages((left.shape[0], right.shape[1]), torch.result_type(left, right), left.device)
    return torch.mm(left, right, out=out)


def _per_sample_by_onednn(first: torch.Tensor, second: torch.Tensor, multiply_adds: int,
                          per_thread: int) -> bool:
    """CPU float32 operands of a non-empty batch whose per-sample product has at least
    ``per_thread`` multiply-adds per thread, with the ``"onednn"`` backend set, and no autograd
    recording the product (oneDNN's product has no derivative in torch)."""
    recorded = torch.is_grad_enabled() and (first.requires_grad or second.requires_grad)
    return (first.device.type == "cpu" and first.dtype == torch.float32 == second.dtype and not recorded
            and first.shape[0] > 0 and multiply_adds >= per_thread * torch.get_num_threads()
            and cpu_products() == "onednn")


def routes_samples_to_onednn(rows: torch.Tensor, cols: torch.Tensor) -> bool:
    """True if :func:`per_sample_products` forms ``rows[i] @ cols[i]ᵀ`` by oneDNN: CPU float32
    operands whose per-sample rows are contiguous, at least ``MIN_SAMPLE_MULTIPLY_ADDS_PER_THREAD``
    multiply-adds per sample and thread, with the ``"onednn"`` backend set, not recorded by autograd."""
    _, r, d = rows.shape
    return (rows.stride(2) == 1 and rows.stride(1) == d
            and _per_sample_by_onednn(rows, cols, r * cols.shape[1] * d, MIN_SAMPLE_MULTIPLY_ADDS_PER_THREAD))


def per_sample_products(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``rows[i] @ cols[i]ᵀ`` for every sample ``i``: ``(B, r, d)``, ``(B, c, d)`` → ``(B, r, c)``, by
    oneDNN one sample at a time where :func:`routes_samples_to_onednn`, else by ``torch.bmm`` (also
    wherever autograd records the product)."""
    if not routes_samples_to_onednn(rows, cols):
        return torch.bmm(rows, cols.transpose(1, 2))
    out = rows.new_empty((rows.shape[0], rows.shape[1], cols.shape[1]))
    for i in range(rows.shape[0]):
        out[i] = _onednn_linear(rows[i], cols[i])
    return out


def routes_outer_sums_to_onednn(left: torch.Tensor, right: torch.Tensor) -> bool:
    """True if :func:`outer_sums` forms ``left[i]ᵀ right[i]`` by oneDNN: CPU float32 operands of at
    least ``MIN_OUTER_SUM_MULTIPLY_ADDS_PER_THREAD`` multiply-adds per sample and thread, with the
    ``"onednn"`` backend set, not recorded by autograd."""
    _, positions, rows = left.shape
    return _per_sample_by_onednn(left, right, rows * positions * right.shape[2],
                                 MIN_OUTER_SUM_MULTIPLY_ADDS_PER_THREAD)


def outer_sums(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``out[i] = left[i]ᵀ right[i]`` for ``left (B, T, o)``, ``right (B, T, p)``: the per-sample
    gradients ``(B, o, p)`` of a ``Linear`` weight; by oneDNN one sample at a time where
    :func:`routes_outer_sums_to_onednn` (into memory advised to huge pages, as
    :func:`~opacus_dp.maths.huge_pages.batched_outer_sums`), else by that function (``torch.bmm``,
    also wherever autograd records the product)."""
    if not routes_outer_sums_to_onednn(left, right):
        return batched_outer_sums(left, right)
    out = empty_on_huge_pages((left.shape[0], left.shape[2], right.shape[2]), left.dtype, left.device)
    for i in range(left.shape[0]):
        out[i] = _onednn_product(left[i].t(), right[i])
    return out

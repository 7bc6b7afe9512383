"""The products that decide a sample's clipped contribution, in IEEE float32 whatever the user
allowed for speed.

PyTorch may run float32 matrix products and convolutions on inputs rounded to fewer bits: TF32
(10 mantissa bits, ``u = 2⁻¹¹``) on NVIDIA Ampere and later — ``torch.backends.cuda.matmul
.allow_tf32``, ``torch.set_float32_matmul_precision("high")``, and cuDNN convolutions by
default — and bfloat16 (``u = 2⁻⁸``) on CPUs with AMX — ``torch.set_float32_matmul_precision
("medium")``, ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``. DP-SGD needs each
sample's summed contribution ``f_i g_i`` to have norm ≤ ``C``: the norm that sets ``f_i`` and the
product that sums the contributions must agree to float32 rounding, and the ghost-norm check
(:mod:`opacus_dp.grad_sample.bookkeeping.norm_samplers.trust`) assumes float32's ``u``. With inputs rounded
to bfloat16 a Gram-form norm whose positions cancel can come out well below the true norm, so
the clip factor is too large and the sample's clipped contribution exceeds ``C``.

:func:`ieee_float32_products` switches every float32-precision setting to IEEE float32 for
the duration of those products (the ghost norms, the clipped sums) and restores the user's
settings afterwards (for products on CPU, the settings that reach them: oneDNN's); the model's
own forward and backward keep them. The settings are global,
so two threads computing clipped sums at once could restore each other's; the norms-only modes
run no layer hooks in parallel threads (``nn.DataParallel`` uses the ``hooks`` mode, whose sums
run in ``optimizer.step``).
"""

import threading
from functools import lru_cache
from typing import Callable, Optional, Tuple

import torch

# (backend, operation) pairs of torch's per-backend ``fp32_precision`` settings (torch ≥ 2.9)
PRECISION_SETTINGS = (("cuda", "matmul"), ("cudnn", "conv"), ("mkldnn", "matmul"), ("mkldnn", "conv"))
CPU_BACKENDS = ("mkldnn",)  # the backends whose settings reach products on CPU (a global setting shows in theirs)
FULL_PRECISION = ("ieee", "none")


@lru_cache(maxsize=None)
def _precision_settings(cpu_only: bool = False) -> Tuple[object, ...]:
    """The objects carrying an ``fp32_precision`` setting in this torch (none before 2.9); with
    ``cpu_only`` those of :data:`CPU_BACKENDS`."""
    found = []
    for backend, operation in PRECISION_SETTINGS:
        if cpu_only and backend not in CPU_BACKENDS:
            continue
        setting = getattr(getattr(torch.backends, backend, None), operation, None)
        if setting is not None and hasattr(setting, "fp32_precision"):
            found.append(setting)
    return tuple(found)


def _legacy_state() -> Tuple[str, bool, bool]:
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


def _set_legacy_state(state: Tuple[str, bool, bool]) -> None:
    torch.set_float32_matmul_precision(state[0])
    torch.backends.cuda.matmul.allow_tf32 = state[1]
    torch.backends.cudnn.allow_tf32 = state[2]


def _switch_to_ieee(cpu_only: bool = False) -> Callable[[], None]:
    """Set IEEE float32 products (``cpu_only``: those on CPU); return the function that restores the
    previous settings."""
    if not _precision_settings():
        saved = _legacy_state()
        _set_legacy_state(("highest", False, False))
        return lambda: _set_legacy_state(saved)
    settings = _precision_settings(cpu_only)
    # The per-backend interface, never read through the legacy getter (which raises once both
    # interfaces were used). An operation's value reflects what was set on its backend or
    # globally; "none" is torch's default, IEEE for these products.
    values = [(s, s.fp32_precision) for s in settings]
    reduced = [(s, value) for s, value in values if value not in FULL_PRECISION]
    for s, _ in reduced:
        s.fp32_precision = "ieee"

    def restore():
        for s, value in reduced:
            s.fp32_precision = value

    return restore


class _Covered(threading.local):
    """Per thread: the widest switch of this module now running (0 none, 1 CPU products, 2 all)."""

    level = 0


_COVERED = _Covered()


def _level_for(device: Optional[torch.device]) -> int:
    """1 if ``device`` is a CPU (only the settings of CPU products need switching), else 2."""
    if device is None:
        return 2
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return 1 if kind == "cpu" else 2


class ieee_float32_products:  # noqa: N801 (a context manager, named as the function it replaced)
    """Float32 matrix products and convolutions in full IEEE precision inside the block; for
    ``device`` a CPU, only the settings that reach CPU products are switched (the CUDA ones, e.g.
    cuDNN's TF32 default, cannot change them: switching and restoring them cost more than the
    small products of many layers). A block inside another block of this thread that switched
    at least as many settings switches nothing (a step's layers enter one block each)."""

    __slots__ = ("_level", "_outer", "_restore")

    def __init__(self, device: Optional[torch.device] = None):
        self._level = _level_for(device)

    def __enter__(self) -> None:
        self._outer = _COVERED.level
        if self._outer >= self._level:
            self._restore = None
            return
        self._restore = _switch_to_ieee(cpu_only=self._level == 1)
        _COVERED.level = self._level

    def __exit__(self, *exc) -> bool:
        if self._restore is not None:
            _COVERED.level = self._outer
            self._restore()
        return False

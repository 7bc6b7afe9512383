"""What the engines read off a data loader: its sample rate ``q``, its steps per pass, the
expected batch size ``⌊q·N⌋`` the ``mean`` reduction divides by, a fixed batch size."""

import math
from typing import Optional

from torch.utils.data import BatchSampler, DataLoader

from opacus_dp.data.sampling_checks import check_batching


def planned_steps(data_loader: DataLoader, epochs) -> int:
    """Steps of ``epochs`` passes: ``⌈epochs · len(data_loader)⌉``.

    The loader used for training (``DPDataLoader.from_data_loader`` of it, or itself) has
    ``len(data_loader)`` batches per pass, each one accounted step. Opacus computes
    ``int(epochs / q)`` instead, which can be fewer steps than the run takes (e.g. a
    DPDataLoader with q = 0.35 takes round(1/q) = 3 steps per pass, not 2; and
    ``1 / (1 / 75)`` is below 75 in floating point): σ would then be too small for the target.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) \
            or epochs <= 0:
        raise ValueError(f"epochs must be a positive number, got {epochs!r}")
    check_batching(data_loader, "data_loader")
    return max(1, math.ceil(epochs * len(data_loader)))


def fixed_batch_size(data_loader: DataLoader) -> Optional[int]:
    """Size of the loader's batches if it draws them with a ``BatchSampler``, else None."""
    batch_sampler = getattr(data_loader, "batch_sampler", None)
    return batch_sampler.batch_size if isinstance(batch_sampler, BatchSampler) else None


def expected_batch_size_for(num_samples: int, sample_rate: float) -> int:
    """``⌊q·N⌋`` (at least 1), as Opacus 1.x; a product within rounding of an integer is that
    integer (``98 · (1/49)`` is 1.9999999999999998 in floating point: 2, not 1)."""
    product = num_samples * sample_rate
    nearest = round(product)
    exact = abs(product - nearest) <= 1e-9 * max(1.0, product)
    return max(1, nearest if exact else math.floor(product))


def sample_rate_of(data_loader: DataLoader) -> float:
    """``q`` of a loader: its own ``sample_rate`` if it has one, else ``1/len(loader)``."""
    rate = getattr(data_loader, "sample_rate", None)
    if rate is not None:
        return float(rate)
    check_batching(data_loader, "data_loader")
    return 1.0 / len(data_loader)

"""The ``fast_noise`` setting of ``make_private``, also by name for settings given as text
(command lines, ``HfArgumentParser`` dataclasses).

``make_private(fast_noise=...)`` takes ``False`` (torch's generator, one thread: the default and
the bits of earlier releases), ``True`` (parallel threads) or ``"philox"`` (counter-based, drawn
and added in one pass: [noise.md](../../docs/noise.md)). Where a setting arrives as text, the names
``"off"``, ``"threads"`` and ``"philox"`` stand for them (:data:`FAST_NOISE_NAMES`).
"""

from typing import Union

FastNoise = Union[bool, str]
FAST_NOISE_NAMES = {"off": False, "threads": True, "philox": "philox"}


def is_fast_noise(value) -> bool:
    """True for a value ``make_private`` takes as ``fast_noise``: ``False``, ``True`` or ``"philox"``."""
    return isinstance(value, bool) or value == "philox"


def fast_noise_setting(value: FastNoise, owner: str) -> FastNoise:
    """``make_private``'s ``fast_noise`` for ``value``: itself, or the setting its name stands for
    (:data:`FAST_NOISE_NAMES`); a ``ValueError`` naming ``owner`` for anything else."""
    if is_fast_noise(value):
        return value
    if isinstance(value, str) and value in FAST_NOISE_NAMES:
        return FAST_NOISE_NAMES[value]
    raise ValueError(
        f"{owner}: fast_noise must be 'off' (torch's generator, the default), 'threads' (parallel threads) "
        f"or 'philox' (counter-based, fused with the add), or make_private's False, True or 'philox'; "
        f"got {value!r}")

"""Clipping rules by name: ``clipping="flat" | "per_layer" | "automatic" | "psac" | "adaptive"``.

A rule is one line of :data:`CLIPPERS`: a factory ``(max_grad_norm, **options) -> Clipper``.
Adaptive clipping's defaults depend on the global expected batch size, which the engine supplies
(``make_private(..., clipping="adaptive")``); asked for without its options it is refused with
the ways to get it.
"""

from typing import Callable, Dict, List

from opacus_dp.optim.adaptive_clipping import adaptive_clipper
from opacus_dp.optim.automatic_clipping import AutomaticClipper
from opacus_dp.optim.clipping import Clipper, FlatClipper, PerLayerClipper
from opacus_dp.optim.psac_clipping import PSACClipper

ClipperFactory = Callable[..., Clipper]


def flat_clipper(max_grad_norm) -> FlatClipper:
    """:class:`~opacus_dp.optim.clipping.FlatClipper`; a list of bounds is refused."""
    if isinstance(max_grad_norm, (list, tuple)):
        raise ValueError(
            "max_grad_norm is a list but clipping='flat': pass clipping='per_layer' "
            "for one bound per trainable tensor, or a single number"
        )
    return FlatClipper(max_grad_norm)


def _adaptive(max_grad_norm, **options) -> Clipper:
    if "expected_batch_size" not in options:
        raise ValueError(
            "clipping='adaptive' needs its settings: use PrivacyEngine.make_private(..., "
            "clipping='adaptive') or opacus_dp.optimizers.AdaClipDPOptimizer, or pass "
            "clipping=AdaptiveClipper(...)")
    return adaptive_clipper(max_grad_norm, **options)


CLIPPERS: Dict[str, ClipperFactory] = {
    "flat": flat_clipper,
    "per_layer": PerLayerClipper,
    "automatic": AutomaticClipper,  # option: gamma
    "psac": PSACClipper,  # option: r
    "adaptive": _adaptive,  # options: expected_batch_size and those of adaptive_clipper
}


def clipping_names() -> List[str]:
    """The names ``clipping`` accepts, in registry order."""
    return list(CLIPPERS)


def make_clipper(clipping, max_grad_norm, **options) -> Clipper:
    """The clipper named ``clipping`` (a key of :data:`CLIPPERS`) with bound(s) ``max_grad_norm``
    and the rule's ``options`` (``gamma`` for "automatic", ``r`` for "psac"); a :class:`Clipper`
    instance is used as it is."""
    if isinstance(clipping, Clipper):
        if options:
            raise ValueError(f"clipping is a {type(clipping).__name__} instance: pass its settings to "
                             f"its constructor, not as options {sorted(options)}")
        return clipping
    factory = CLIPPERS.get(clipping) if isinstance(clipping, str) else None
    if factory is None:
        raise ValueError(f"clipping must be one of {clipping_names()} or a Clipper instance, got {clipping!r}")
    return factory(max_grad_norm, **options)

"""Where the empty draws of a skipping Poisson sampler go (Opacus 0.x's sampler).

With ``DataLoader(dataset, batch_sampler=UniformWithReplacementSampler(...))`` and torch's default
collate an empty draw cannot become a batch (``default_collate([])`` fails). So the sampler, as
in Opacus 0.x, never yields it; it reports it here instead. A privacy engine that follows the
draws of rate ``q`` (the classic ``PrivacyEngine(..., poisson=True)`` after ``attach``) takes the
step of that draw right away: noise only, the parameters updated, one ``(σ, q)`` record — the
step a loader delivering the empty batch would have taken. A draw nobody follows is skipped
with a :class:`SamplingWarning` (once per sampler): it is neither a step nor accounted.

Skipping samplers also register here while alive (:func:`live_sampler_of_rate`), so that the
classic engine attached without ``poisson=True`` can recognise Opacus 0.14's loader.
"""

import math
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Optional, Tuple

from torch.utils.hooks import RemovableHandle

from opacus_dp.data.sampling_warning import SamplingWarning

EmptyDrawCallback = Callable[[object], bool]  # (the sampler that drew nothing) -> step taken

_FOLLOWERS: "OrderedDict[int, Tuple[float, EmptyDrawCallback]]" = OrderedDict()  # weak-referenceable
_LIVE_SAMPLERS: "weakref.WeakSet" = weakref.WeakSet()  # skipping samplers not yet collected


def register_skipping_sampler(sampler) -> None:
    """Note ``sampler`` (with ``sample_rate``, ``num_samples``, ``skip_empty``) while it is alive."""
    _LIVE_SAMPLERS.add(sampler)


def live_sampler_of_rate(sample_rate: float) -> Optional[object]:
    """The live skipping sampler of rate ``sample_rate`` (equal up to 1e-9 relative), or None
    when there is none or the matching ones disagree on ``num_samples`` (which one feeds the
    loop is then unknown)."""
    matching = [s for s in list(_LIVE_SAMPLERS)
                if s.skip_empty and math.isclose(float(s.sample_rate), float(sample_rate), rel_tol=1e-9)]
    if not matching or len({s.num_samples for s in matching}) != 1:
        return None
    return matching[0]


def follow_empty_draws_of_rate(sample_rate: float, callback: EmptyDrawCallback) -> RemovableHandle:
    """Call ``callback(sampler)`` for every empty draw of a skipping sampler of rate
    ``sample_rate`` (equal up to 1e-9 relative); it returns whether it took the draw's step.
    ``handle.remove()`` stops it."""
    handle = RemovableHandle(_FOLLOWERS)
    _FOLLOWERS[handle.id] = (float(sample_rate), callback)
    return handle


def report_empty_draw(sampler) -> int:
    """Hand the empty draw of ``sampler`` to every follower of its rate; returns the number of
    steps they took.

    When none took a step, the draw is skipped and, once per sampler, a :class:`SamplingWarning`
    says that it was not accounted."""
    rate = float(sampler.sample_rate)
    followers = [cb for q, cb in list(_FOLLOWERS.values()) if math.isclose(q, rate, rel_tol=1e-9)]
    taken = sum(bool(callback(sampler)) for callback in followers)
    if not taken and not getattr(sampler, "_warned_unfollowed", False):
        sampler._warned_unfollowed = True
        warnings.warn(
            f"{type(sampler).__name__} drew an empty batch (sample_rate={rate:.4g}) and skipped it, "
            "as Opacus 0.x did, but no privacy engine follows this rate, so no step was taken or "
            "accounted for it: attach PrivacyEngine(..., sample_rate=q, sample_size=len(dataset), "
            "poisson=True) before iterating (or create this sampler before attaching "
            "PrivacyEngine(..., sample_rate=q)), or use opacus_dp.data.DPDataLoader, which "
            "delivers empty batches", SamplingWarning, stacklevel=3)
    return taken

"""The step event: what one released private step adds to the privacy history (as data).

A step that merges ``k`` sampled batches (``k`` backward passes counted by the optimizer, its
``accumulated_iterations``) of sample rate ``q`` is recorded as one step of the sampled Gaussian
mechanism with rate ``min(1, k·q)``: a sample is in the merged batch with probability at most
``k·q`` (union bound). :func:`step_event` is the one place this rule lives; the accountant's
step hook and the budget guard (which checks the event before the step) both take the event it
gives. Nothing here imports the optimizer: it is read through Opacus's hook contract
(``noise_multiplier``, ``accumulated_iterations``).
"""

from typing import NamedTuple


class StepEvent(NamedTuple):
    """``steps`` steps of the sampled Gaussian mechanism with noise ``σ`` and rate ``q``."""

    noise_multiplier: float
    sample_rate: float
    steps: int = 1


def recorded_sample_rate(sample_rate: float, merged_batches: int = 1) -> float:
    """``min(1, k·q)`` for ``k = merged_batches`` batches of rate ``q`` merged into one step."""
    return min(1.0, float(sample_rate) * int(merged_batches))


def step_event(optimizer, sample_rate: float) -> StepEvent:
    """The event of the step ``optimizer`` releases now (its σ and ``k``; ``k = 1`` for an
    optimizer that does not count merged batches)."""
    merged = getattr(optimizer, "accumulated_iterations", 1)
    return StepEvent(optimizer.noise_multiplier, recorded_sample_rate(sample_rate, merged))

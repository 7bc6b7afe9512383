"""Arguments of the classic API: sampling (and Opacus 0.14's recognised sampler), σ calibration,
Opacus 0.x's extra settings."""

import math
import warnings
import weakref
from typing import Optional, Sequence, Tuple

from opacus_dp.accountants import get_noise_multiplier
from opacus_dp.accountants.validation import warn_if_delta_not_small
from opacus_dp.data import SamplingWarning
from opacus_dp.data.empty_draw_steps import follow_empty_draws
from opacus_dp.data.empty_draws import live_sampler_of_rate
from opacus_dp.data.step_per_batch import follow_live_loaders
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind

# Opacus 0.x default RDP orders: 1.1, 1.2, ..., 10.9 and 12, ..., 63.
DEFAULT_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def classic_sampling(*, batch_size, sample_size, sample_rate, poisson: bool, world_size: int,
                     loss_reduction: str) -> Tuple[float, Optional[int], Optional[int], Optional[float]]:
    """``(q, batch_size, sample_size, expected_batch_size)`` from the classic arguments.

    ``q = batch_size · world_size / sample_size`` unless ``sample_rate`` is given. The expected
    (per-process) batch size divides the mean; it is ``None`` — divide by the actual batch size,
    as Opacus 0.x did — only for fixed-size batches without ``batch_size``/``sample_size``.
    """
    if batch_size is not None:
        batch_size = _positive_int(batch_size, "batch_size")
    if sample_size is not None:
        sample_size = _positive_int(sample_size, "sample_size")
    if sample_rate is None:
        if batch_size is None or sample_size is None:
            raise ValueError("pass batch_size and sample_size (q = batch_size/sample_size), or sample_rate")
        if batch_size * world_size > sample_size:
            raise ValueError(f"batch_size ({batch_size}) x world size ({world_size}) must not exceed "
                             f"sample_size ({sample_size})")
        return batch_size * world_size / sample_size, batch_size, sample_size, batch_size
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
            or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    expected = _expected_batch_size(float(sample_rate), batch_size, sample_size, world_size)
    if expected is None and poisson and loss_reduction == "mean":
        raise ValueError("poisson=True with loss_reduction='mean' needs sample_size (or batch_size): "
                         "the mean divides by the expected batch size q·sample_size")
    return float(sample_rate), batch_size, sample_size, expected


def _expected_batch_size(q, batch_size, sample_size, world_size) -> Optional[float]:
    if batch_size is not None:
        if sample_size is not None and not math.isclose(batch_size * world_size / sample_size, q,
                                                         rel_tol=1e-6):
            raise ValueError(f"sample_rate={q} disagrees with batch_size/sample_size="
                             f"{batch_size * world_size}/{sample_size}: pass only one of them")
        return batch_size
    if sample_size is not None:
        return q * sample_size / world_size
    return None


def steps_per_epoch(sample_rate: float) -> int:
    """Batches in one pass over the data: ``⌈1/q⌉`` (up to floating-point noise in ``1/q``).

    That is the number of batches of a ``DataLoader(batch_size=B)`` over ``N = B/q`` examples
    (last batch kept) and at least ``round(1/q)``, the steps of a Poisson sampler's pass;
    Opacus 0.x used ``⌊1/q⌋``, fewer steps than the run takes when ``B`` does not divide ``N``.
    """
    return max(1, math.ceil((1.0 / sample_rate) * (1 - 1e-12)))


def calibrate_noise_multiplier(noise_multiplier, *, target_epsilon, target_delta, sample_rate: float, sample_size,
                               epochs, alphas: Sequence[float]) -> float:
    """``noise_multiplier`` if given (a ``target_epsilon`` beside it is ignored, as in Opacus 0.x,
    with a warning), else σ such that ``⌈epochs · steps_per_epoch(q)⌉`` steps spend at most
    ``target_epsilon`` (RDP over ``alphas``)."""
    if noise_multiplier is not None:
        if target_epsilon is not None:
            warnings.warn(f"PrivacyEngine: noise_multiplier={noise_multiplier} was given, so target_epsilon="
                          f"{target_epsilon} is ignored (σ is not calibrated to it; get_privacy_spent reports the "
                          "ε spent). Pass noise_multiplier=None to calibrate σ to target_epsilon and epochs",
                          UserWarning, stacklevel=3)
        return noise_multiplier
    warn_if_delta_not_small(target_delta, sample_size)
    if target_epsilon is None or epochs is None:
        raise ValueError("noise_multiplier is None: pass noise_multiplier, or target_epsilon and "
                         "epochs to calibrate it")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) \
            or epochs <= 0:
        raise ValueError(f"epochs must be a positive number, got {epochs!r}")
    steps = max(1, math.ceil(epochs * steps_per_epoch(sample_rate)))
    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                      sample_rate=sample_rate, steps=steps, accountant="rdp",
                                      alphas=list(alphas)))


def check_every_trainable_parameter_attached(module, optimizer) -> None:
    """ValueError if a trainable parameter of ``module`` is not in ``optimizer``: Opacus 0.x's
    step clipped and noised the gradient of every trainable parameter of the module, the attached
    optimizer's step only its own, so another optimizer would apply autograd's gradient there."""
    attached = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in attached]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(
            f"trainable parameters of the model are not in the optimizer given to attach: {shown}. Their "
            "gradients would be neither clipped nor noised (Opacus 0.x made every trainable parameter's "
            "gradient private), so another optimizer stepping them would train on non-private gradients. "
            "Add them to this optimizer (optimizer.add_param_group) or freeze them (p.requires_grad_(False)) "
            "before attach")


def refuse_sample_rate_change(engine, value) -> None:
    """The setter of a classic engine's ``sample_rate``: refused (its steps record the rate given
    when it was built, so a new rate set on it would not be accounted)."""
    if value == engine.sample_rate:
        return
    raise AttributeError(
        f"sample_rate is fixed when the PrivacyEngine is built ({engine.sample_rate:.4g}; got {value!r}): "
        "every step records it, so batches drawn at another rate would not be accounted. For another "
        "rate, detach this engine and attach PrivacyEngine(model, sample_rate=..., ...) after its "
        "load_state_dict(engine.state_dict()), which keeps the privacy history")


def warn_fixed_size_batches(sample_rate: float) -> None:
    """The classic engine cannot see the loader: say what the accounting assumes."""
    warnings.warn(
        f"privacy is accounted as Poisson sampling with sample_rate={sample_rate:.4g}, but "
        "poisson=False: shuffled fixed-size batches are not covered by that analysis and may be "
        "less private than reported. Draw Poisson batches and pass poisson=True, "
        "sample_size=len(dataset): with opacus_dp.data.DPDataLoader(dataset, "
        f"sample_rate={sample_rate:.4g}), which also delivers empty batches, or with a DataLoader "
        "whose batch_sampler is UniformWithReplacementSampler(num_samples=len(dataset), "
        f"sample_rate={sample_rate:.4g}) (its empty draws are steps of the attached engine; one "
        "such sampler created before attach is recognised without those arguments)",
        SamplingWarning, stacklevel=3,
    )


def recognised_0x_sampler(*, poisson: bool, world_size: int, batch_size, sample_size, sample_rate: float):
    """The sampler of Opacus 0.14's loop, or None.

    That loop is ``DataLoader(dataset, batch_sampler=UniformWithReplacementSampler(num_samples=N,
    sample_rate=q))`` with ``PrivacyEngine(model, sample_rate=q, ...)`` (``poisson`` left False,
    no ``batch_size``). Its batches are Poisson draws of rate q over N examples, so the engine
    runs as ``poisson=True, sample_size=N``. Recognised only in one process, when exactly one N
    belongs to the live skipping samplers of rate q and ``sample_size`` (if given) is that N;
    :class:`SamplerFeed` warns if the steps then outnumber that sampler's draws.
    """
    if poisson or world_size != 1 or batch_size is not None:
        return None
    sampler = live_sampler_of_rate(sample_rate)
    if sampler is None or sample_size not in (None, sampler.num_samples):
        return None
    return sampler


class PoissonDrawsFollowed:
    """While a classic engine with ``poisson=True`` is attached in one process: every empty draw
    of a skipping 0.x sampler of its rate is a step (:mod:`~opacus_dp.data.empty_draw_steps`), and
    every live ``DPDataLoader`` of its rate refuses a batch whose predecessor got no step, such as
    Poisson batches merged with ``virtual_step`` (:mod:`~opacus_dp.data.step_per_batch`)."""

    def __init__(self, optimizer, *, sample_rate: float):
        self._empty_draws = follow_empty_draws(optimizer, sample_rate=sample_rate)
        self._loaders = follow_live_loaders(dp_optimizer_behind(optimizer), sample_rate)

    def remove(self) -> None:
        self._empty_draws.remove()
        for check in self._loaders:
            check.unfollow()


class SamplerFeed:
    """Checks, before each step, that the recognised sampler drew at least one batch per step
    since ``attach`` (draws_k ≥ k before step k; prefetching loaders draw ahead). Warns once
    otherwise: those batches are not the Poisson draws the accountant assumes."""

    def __init__(self, sampler, steps_now: int):
        self._sampler = weakref.ref(sampler)
        self._draws_at_attach, self._steps_at_attach = sampler.draws, steps_now
        self._described = f"{type(sampler).__name__}(num_samples={sampler.num_samples}, " \
                          f"sample_rate={sampler.sample_rate:.4g})"
        self.warned = False

    def check(self, steps_now: int) -> None:
        if self.warned:
            return
        sampler = self._sampler()
        draws = 0 if sampler is None else sampler.draws - self._draws_at_attach
        step = steps_now - self._steps_at_attach + 1
        if draws >= step:
            return
        self.warned = True
        warnings.warn(
            f"step {step} after attach came after only {draws} draws of {self._described}, which "
            "was alive at attach and taken for this loop's sampler (the engine was given "
            "sample_rate, poisson=False): privacy is accounted as Poisson sampling, which "
            "shuffled fixed-size batches are not covered by and may be less private than "
            "reported. Sample with that sampler, or pass poisson=True, sample_size=len(dataset) "
            "and use opacus_dp.data.DPDataLoader(dataset, sample_rate=q)",
            SamplingWarning, stacklevel=4)


def check_misc_settings(*, enable_stat: bool, experimental: bool, clipping_method, clipping_ratio,
                        clipping_momentum) -> None:
    """Opacus 0.x's extra settings: ``enable_stat`` (clipping statistics for TensorBoard; not
    kept here, a warning says so, training is unchanged); ``experimental=True`` with a dynamic
    ``clipping_method`` (anything but the default, static one) is refused: those methods set the
    bound from the batch's norms without noise, which is not differentially private; the
    clipping settings were ignored without ``experimental`` (a warning says so)."""
    if experimental and not _static_clipping(clipping_method):
        raise ValueError(
            "experimental=True selects Opacus 0.x's dynamic clipping bounds, computed from each "
            "batch's gradient norms without noise: not differentially private. Use a fixed "
            "max_grad_norm, or PrivacyEngine().make_private(..., clipping='adaptive') (a private "
            "estimate of a quantile of the norms)")
    ignored = [name for name, value in (("clipping_method", clipping_method), ("clipping_ratio", clipping_ratio),
                                        ("clipping_momentum", clipping_momentum)) if value is not None]
    if ignored and not experimental:
        warnings.warn(f"{', '.join(ignored)} only apply with experimental=True (as in Opacus 0.x): ignored",
                      UserWarning, stacklevel=3)
    if enable_stat:
        warnings.warn("enable_stat=True: Opacus 0.x's clipping statistics (opacus.utils.stats) are not "
                      "kept; training and privacy are unchanged", UserWarning, stacklevel=3)


def _static_clipping(method) -> bool:
    """True for Opacus 0.x's default ``ClippingMethod.STATIC`` (None, 0, "static" or the enum)."""
    name = getattr(method, "name", method)
    return method is None or name == 0 or str(name).upper() == "STATIC"

"""Samples whose per-sample gradient norm is NaN or inf: dropped from the step, privately.

A NaN or inf norm ``n_il`` (a NaN input or loss, an overflow of the float16 backward under a
``GradScaler``, a gradient whose squared norm overflows float32) could either stop the step or
drop the sample. Stopping it (an error, a skipped step) depends on the batch's data: whether a
step happens would tell whether the batch held such a sample, one bit per step that no noise
covers. So by default (``non_finite_samples = "drop"``) the sample is dropped:

* its norm counts as ``+inf``: the clip factor ``f = min(1, C / (n + 1e-6))`` is 0 — for every
  tensor with flat (and adaptive) clipping, for that tensor alone with per-layer clipping;
* its rows are zeroed before any product (``0 · NaN = NaN``; :mod:`opacus_dp.maths.per_sample`),
  so the clipped sum is that of the other samples, exactly;
* the step goes on as always: noise, ``p.grad``, the accountant's record.

Dropping is within the sensitivity: the sample's contribution ``0`` has norm ``0 ≤ C``, the
sum is the one a neighbouring dataset without that sample would give (or, with per-layer clipping,
one with that tensor's part of it removed), and the expected batch size that scales the mean is
unchanged. The cost is utility: the sample's signal is lost, silently (counting the dropped
samples would be another release of the data).

``non_finite_samples = "refuse"`` restores the error (a ``ValueError`` naming the tensor, nothing
updated) for debugging on public or synthetic data; a refusal reveals that the batch held such a
sample, so it is not private.
"""

from typing import Callable, List, Sequence, Tuple

import torch

from opacus_dp.maths.per_sample import all_finite, check_finite_norm_list

DROP, REFUSE = "drop", "refuse"
POLICIES = (DROP, REFUSE)


def check_policy(policy) -> str:
    """``policy`` if it is ``"drop"`` or ``"refuse"``, else ValueError."""
    if policy not in POLICIES:
        raise ValueError(f"non_finite_samples must be one of {POLICIES}, got {policy!r}")
    return policy


def screen_norms(norms: Sequence[torch.Tensor], policy: str,
                 name_of: Callable[[int], str]) -> Tuple[List[torch.Tensor], bool]:
    """``(norms, dropping)``: the norms with NaN and inf as ``+inf`` (clip factor 0), and whether
    there was one. One finiteness check per device. With ``"refuse"`` a non-finite norm raises
    :func:`~opacus_dp.maths.per_sample.check_finite_norm_list`'s ValueError (``name_of(index)``)."""
    policy, norms = check_policy(policy), list(norms)
    if all_finite(norms):
        return norms, False
    if policy == REFUSE:
        check_finite_norm_list(norms, name_of)
    return [torch.where(torch.isfinite(n), n, torch.inf) for n in norms], True

"""Compare a rerun (encoded by :func:`tests.pinning.pin.encode_case`) with the pinned record.

``exact``: every tensor's SHA-256, ε, the history, σ, C and the other ranks' digests must be equal.
Otherwise (another machine's record) tensors must satisfy
``|new − old| ≤ rtol·|old| + rtol·max|old|`` (``rtol`` = 1e-5; the second term, relative to the
tensor's largest entry, covers entries near zero) and ε, σ, q must agree within 1e-9 relative;
C (which adaptive clipping moves with the data) within 1e-5 relative. A case whose σ was calibrated
(``make_private_with_epsilon``) may stop anywhere in the calibration's window, ``target − 0.005 <
ε ≤ target`` (ε ≈ 2 here: 2.5e-3 relative), and which point it reaches depends on ε's last bits
(its bisection steps compare with the target): there ε, σ and the history must agree within
:data:`CALIBRATION_RTOL`, and the tensors within ``rtol`` plus σ's relative change (the noise is
proportional to σ).
"""

import base64
import math
from dataclasses import dataclass

import torch

from tests.pinning.pin import EPSILON_RTOL, PARAM_RTOL, RECORD_HINT

TENSOR_KINDS = ("params", "grads")
CALIBRATION_RTOL = 2.5e-3


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "bitwise" | "within tolerance" | "differs" | "error"
    detail: str = ""

    @property
    def passed_exact(self) -> bool:
        return self.status == "bitwise"

    @property
    def passed_tolerance(self) -> bool:
        return self.status in ("bitwise", "within tolerance")

    def line(self) -> str:
        return f"{self.name}: {self.status}" + (f" {self.detail}" if self.detail else "")


def decode_tensor(entry: dict) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"].split(".")[-1])
    raw = bytearray(base64.b64decode(entry["data"]))
    if not raw:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(entry["shape"]).clone()


def _floats(value):
    """Hex floats (possibly nested in lists) back to floats; other values unchanged."""
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return float.fromhex(value) if isinstance(value, str) else value


def _close(old, new, rtol: float) -> bool:
    old, new = _floats(old), _floats(new)
    if isinstance(old, list) or isinstance(new, list):
        return (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
                and all(_close(a, b, rtol) for a, b in zip(old, new)))
    if isinstance(old, float) and isinstance(new, (int, float)):
        return math.isclose(old, new, rel_tol=rtol, abs_tol=0.0) or old == new
    return old == new


def _tensor_pairs(old: dict, new: dict):
    """``(label, old entry, new entry)`` for every tensor; ValueError if the layouts differ."""
    for kind in TENSOR_KINDS:
        if len(old[kind]) != len(new[kind]):
            raise ValueError(f"{kind}: {len(old[kind])} tensors pinned, {len(new[kind])} now")
        for i, (a, b) in enumerate(zip(old[kind], new[kind])):
            if (a is None) != (b is None) or (a is not None and (a["dtype"], a["shape"]) != (b["dtype"], b["shape"])):
                layout = [e and (e["dtype"], e["shape"]) for e in (a, b)]
                raise ValueError(f"{kind}[{i}]: pinned {layout[0]}, now {layout[1]}")
            if a is not None:
                yield f"{kind}[{i}]", a, b


def _tensor_deltas(old: dict, new: dict, rtol: float = PARAM_RTOL):
    """``(largest |Δ| and where, every tensor within tolerance)`` over the case's tensors."""
    worst, where, within = 0.0, "", True
    for label, a, b in _tensor_pairs(old, new):
        if a["sha256"] == b["sha256"]:
            continue
        x, y = decode_tensor(a).double(), decode_tensor(b).double()
        delta = (y - x).abs()
        largest = float(delta.max()) if delta.numel() else 0.0
        if not largest <= worst:  # NaN counts as the worst
            worst, where = largest, label
        within &= bool((delta <= rtol * (x.abs() + x.abs().max())).all())
    return worst, where, within


def _scalar_differences(old: dict, new: dict, exact: bool, accounting_rtol: float = EPSILON_RTOL):
    """Names (with both values) of the scalars that differ (exactly, or beyond tolerance)."""
    tolerances = {"epsilon": accounting_rtol, "history": accounting_rtol, "noise_multiplier": accounting_rtol,
                  "max_grad_norm": PARAM_RTOL}
    differ = []
    for key, rtol in tolerances.items():
        same = old[key] == new[key] if exact else _close(old[key], new[key], rtol)
        if not same:
            differ.append(f"{key} {_floats(old[key])} → {_floats(new[key])}")
    if exact and old["other_ranks"] != new["other_ranks"]:
        differ.append("other ranks' tensors " + ", ".join(
            r for r in sorted(set(old["other_ranks"]) | set(new["other_ranks"]))
            if old["other_ranks"].get(r) != new["other_ranks"].get(r)))
    return differ


def compare_case(name: str, old, new, exact: bool) -> Verdict:
    """The verdict on case ``name``: pinned entry ``old`` against rerun ``new`` (either may be None)."""
    if old is None:
        return Verdict(name, "differs", f"is not in the pin: {RECORD_HINT}")
    if new is None:
        return Verdict(name, "differs", "is pinned but no longer in the matrix of tests/pinning/cases.py")
    if "error" in old or "error" in new:
        return Verdict(name, "error", f"pinned: {old.get('error', 'values')}; now: {new.get('error', 'values')}")
    calibrated = not exact and "-with_epsilon-" in name
    sigma_change = _relative_change(old["noise_multiplier"], new["noise_multiplier"]) if calibrated else 0.0
    try:
        worst, where, within = _tensor_deltas(old, new, PARAM_RTOL + sigma_change)
    except ValueError as error:
        return Verdict(name, "differs", f"in layout: {error}")
    scalars = _scalar_differences(old, new, exact, CALIBRATION_RTOL if calibrated else EPSILON_RTOL)
    if worst == 0.0 and not scalars and all(
            a["sha256"] == b["sha256"] for _, a, b in _tensor_pairs(old, new)):
        return Verdict(name, "bitwise")
    detail = f"by max |Δ| = {worst:.3e}" + (f" (in {where})" if where else "")
    detail += "".join(f"; {s}" for s in scalars)
    if not exact and within and not scalars:
        return Verdict(name, "within tolerance", detail)
    return Verdict(name, "differs", detail)


def _relative_change(old, new) -> float:
    """``|new − old| / |old|`` of two floats (inf if either is not a positive finite float)."""
    old, new = _floats(old), _floats(new)
    if not (isinstance(old, float) and isinstance(new, float) and 0 < old < math.inf and math.isfinite(new)):
        return math.inf if old != new else 0.0
    return abs(new - old) / old


def compare_pins(pinned: dict, current: dict, exact: bool):
    """Verdicts for the union of the pinned and current case names, in the pinned order first."""
    names = list(pinned) + [n for n in current if n not in pinned]
    return [compare_case(n, pinned.get(n), current.get(n), exact) for n in names]

"""Record the pinned runs of :mod:`tests.pinning.cases` as JSON and compare a rerun with a record.

Per case the record holds, for every final parameter and every ``p.grad``: the SHA-256 of the
tensor's raw bytes, its dtype and shape, its float64 sum and first values (for reading a diff) and
the raw bytes themselves (base64, so that a difference can be measured); ε at δ = 1e-5 as
``float.hex()``; the accountant's history ``(σ, q, steps)`` with floats as hex; σ and C; and a digest
of every other rank's tensors (DDP and FSDP2 ranks must end alike). A case the library failed is an
``{"error": ...}`` entry. The record carries the machine's fingerprint: on the same fingerprint a
rerun must be bitwise equal; elsewhere it must agree within :data:`PARAM_RTOL` (tensors) and
:data:`EPSILON_RTOL` (ε, σ, q).
"""

import base64
import hashlib
import json
import platform
from pathlib import Path

import numpy
import torch

from opacus_dp.maths.cpu_products import _cpu_flags_and_vendor, cpu_products

from tests.pinning.cases import CASES, WORLD_SIZE, run_cases

FORMAT = 1
DEFAULT_PIN = Path(__file__).resolve().parents[1] / "data" / "behaviour_pin.json"
PARAM_RTOL, EPSILON_RTOL, FIRST_VALUES = 1e-5, 1e-9, 4
JOB_TIMEOUT_S = 120.0  # a whole job; each collective is bounded by 30 s (tests/distributed/spawn.py)
RECORD_HINT = "run `.venv/bin/python scripts/pin_behaviour.py record` to write it"


def fingerprint() -> dict:
    """What decides whether a rerun can be bitwise equal: torch, its CPU kernels, the machine, numpy,
    the CPU's vendor (MKL picks its kernels by vendor: AVX2 ones on an AMD CPU with AVX-512) and
    which library forms the clipped sums' products (:mod:`opacus_dp.maths.cpu_products`)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "numpy": numpy.__version__,
            "cpu_vendor": _cpu_flags_and_vendor()[1], "cpu_products": cpu_products()}


# --------------------------------------------------------------------------- running
def run_all(reductions=tuple(CASES)) -> dict:
    """``{case name: [report of each rank]}``; the distributed reductions in one spawned job each.
    A job that fails as a whole (a hang, a crash) makes an error report for each of its cases."""
    from tests.distributed.spawn import run_on_ranks

    reports = {}
    for reduction in reductions:
        world = WORLD_SIZE[reduction]
        try:
            ranks = ([run_cases(0, 1, reduction)] if world == 1
                     else run_on_ranks(run_cases, world, reduction, None, timeout=JOB_TIMEOUT_S))
        except Exception as error:  # the job as a whole: every case of it reports the error
            failed = {"error": f"the {reduction} job failed: {type(error).__name__}: {error} "
                               "(a rank's own traceback is on stderr)"}
            ranks = [{case.name: failed for case in CASES[reduction]}] * world
        for name in ranks[0]:
            reports[name] = [rank[name] for rank in ranks]
    return reports


# --------------------------------------------------------------------------- encoding
def encode_tensor(t) -> dict:
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    raw = t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()
    flat = t.double().reshape(-1)
    return {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": hashlib.sha256(raw).hexdigest(),
            "sum": float(flat.sum()), "first": flat[:FIRST_VALUES].tolist(), "data": base64.b64encode(raw).decode()}


def _scalar(value):
    """Floats as ``float.hex()`` (exact); lists element-wise; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return [_scalar(v) for v in value]
    return float(value).hex() if isinstance(value, float) else value


def _digest(report: dict) -> str:
    h = hashlib.sha256()
    for t in report["params"] + report["grads"]:
        h.update(b"none" if t is None else t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def encode_case(ranks: list) -> dict:
    """The JSON entry of one case from the reports of its ranks (rank 0's values in full)."""
    errors = [f"rank {r}: {report['error']}" for r, report in enumerate(ranks) if "error" in report]
    if errors:
        return {"error": "; ".join(errors)}
    first = ranks[0]
    return {"params": [encode_tensor(t) for t in first["params"]], "grads": [encode_tensor(t) for t in first["grads"]],
            "epsilon": float(first["epsilon"]).hex(), "epsilon_value": float(first["epsilon"]),
            "history": _scalar([list(e) for e in first["history"]]),
            "noise_multiplier": _scalar(first["noise_multiplier"]), "max_grad_norm": _scalar(first["max_grad_norm"]),
            "other_ranks": {str(r): _digest(report) for r, report in enumerate(ranks) if r > 0}}


def record(path=DEFAULT_PIN, reductions=tuple(CASES)) -> dict:
    """Run every case and write the pin file; returns what was written."""
    pin = {"format": FORMAT, "fingerprint": fingerprint(),
           "cases": {name: encode_case(ranks) for name, ranks in run_all(reductions).items()}}
    Path(path).write_text(json.dumps(pin, indent=1, sort_keys=True) + "\n")
    return pin


def load_pin(path=DEFAULT_PIN) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no behaviour pin at {path}: {RECORD_HINT}")
    pin = json.loads(path.read_text())
    if pin.get("format") != FORMAT:
        raise ValueError(f"{path} has format {pin.get('format')!r}, this harness reads {FORMAT}: {RECORD_HINT}")
    return pin

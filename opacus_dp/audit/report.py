"""Human-readable and JSON views of an :class:`~opacus_dp.audit.white_box.AuditReport`."""

import dataclasses
import math
from typing import Any, Dict

from opacus_dp.audit.user_canaries import describe_units
from opacus_dp.audit.white_box import AuditReport

_METHOD_NAMES = {
    "gdp": "GDP bound (Nasr et al. 2023)",
    "plain": "(eps, delta) bound from FPR/FNR",
    "one_run": "one-run bound (Steinke et al. 2023)",
}
_WIDTH = 42


def _number(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3f}"


def _describe_setup(report: AuditReport) -> str:
    c = report.config
    mode = c.grad_sample_mode if c.api == "modern" else "hooks, classic API"
    virtual = "" if c.max_physical_batch_size is None else f", physical batches ≤ {c.max_physical_batch_size}"
    units = describe_units(c)
    return (f"DP-SGD audit: noise_multiplier={c.noise_multiplier:g}, max_grad_norm={c.max_grad_norm:g}, "
            f"sample_rate={c.sample_rate:g}, steps={c.steps}, {mode}{virtual}\n"
            f"canaries: {c.num_canaries} white-box Dirac canaries ({c.num_runs} run(s) x "
            f"{c.canaries_per_run}), delta={c.delta:g}" + ("" if units is None else f"\n{units}"))


def format_report(report: AuditReport) -> str:
    """The accountant's ε next to the empirical lower bounds, with the confidence level."""
    c = report.config
    headline = report.headline_method
    bounds = {"gdp": report.gdp.epsilon_gdp, "plain": report.plain.epsilon_plain,
              "one_run": report.one_run.epsilon_lower_bound}
    lines = [_describe_setup(report),
             f"{f'accountant ({c.accountant}) epsilon:':<{_WIDTH + 2}} {_number(report.accountant_epsilon)}"]
    if report.gaussian_epsilon is not None:
        lines.append(f"{'exact epsilon of the Gaussian mechanism:':<{_WIDTH + 2}} "
                     f"{_number(report.gaussian_epsilon)}")
    lines.append(f"empirical lower bounds on epsilon at {100 * c.confidence:g}% confidence:")
    for method, value in bounds.items():
        marker = "  <- headline" if method == headline else ""
        lines.append(f"  {_METHOD_NAMES[method] + ':':<{_WIDTH}} {_number(value)}{marker}")
    lines.append(f"  (GDP: mu >= {report.gdp.mu_lower_bound:.3f}; FPR <= {report.gdp.fpr_upper:.3f}, "
                 f"FNR <= {report.gdp.fnr_upper:.3f} at threshold {report.gdp.threshold:.3f})")
    verdict = ("VIOLATION: the lower bound exceeds the accountant's epsilon" if report.violates_claim
               else "consistent: the lower bound does not exceed the accountant's epsilon")
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def report_to_dict(report: AuditReport) -> Dict[str, Any]:
    """A JSON-serialisable dictionary of the report (config, ε values, every bound)."""
    return {
        "config": dataclasses.asdict(report.config),
        "accountant_epsilon": report.accountant_epsilon,
        "gaussian_epsilon": report.gaussian_epsilon,
        "confidence": report.config.confidence,
        "delta": report.config.delta,
        "headline_method": report.headline_method,
        "epsilon_lower_bound": report.epsilon_lower_bound,
        "violates_claim": report.violates_claim,
        "gdp": dataclasses.asdict(report.gdp),
        "plain": dataclasses.asdict(report.plain),
        "one_run": dataclasses.asdict(report.one_run),
    }

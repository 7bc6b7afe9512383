"""Privacy calculator: ε of a DP-SGD run, and the noise needed for a target ε.

Usage (console script ``opacus-dp-calculator`` or ``python -m opacus_dp.cli``)::

    opacus-dp-calculator -r 0.004267 -n 1.1 -e 60 -d 1e-5
    opacus-dp-calculator --batch-size 256 --dataset-size 60000 --steps 14063 -n 1.1 --json
    opacus-dp-calculator -r 0.01 -e 10 --target-epsilon 3 --accountant rdp
    opacus-dp-calculator -r 0.0125 -n 1.1 --steps 1000 --noise-mechanism banded --bands 4
    opacus-dp-calculator -r 0.01 -n 1.1 --steps 1000 --privacy-unit user --max-examples-per-user 4

The flags ``-r/--sample-rate``, ``-n/--noise-multiplier``, ``-e/--epochs``, ``-d/--delta`` and
``-a/--alphas`` are those of Opacus's ``compute_dp_sgd_privacy`` script, and so is the step
count of ``--epochs``: ``ceil(epochs × ceil(1/q))`` (``ceil(N/B)`` batches per epoch with
``--batch-size``/``--dataset-size``), never fewer than a run really takes.  The accountant is
``prv`` unless ``--alphas`` is given, which selects ``rdp`` as in Opacus's script.
``--noise-mechanism`` accounts a correlated-noise run by its reduction
(:mod:`opacus_dp.mechanisms.accounting`; ``-r`` stays the rate of one step, ``q``).
``--privacy-unit user`` reports ε per user contributing at most ``--max-examples-per-user`` examples
(group privacy, :mod:`opacus_dp.accountants.group_privacy`), with the example-level δ' it uses;
``--target-epsilon`` is then a per-user budget.
"""

import argparse
import json
import math
import sys
import warnings
from typing import List, Optional, Tuple

from opacus_dp.accountants import create_accountant, get_noise_multiplier
from opacus_dp.accountants.group_privacy import PRIVACY_UNITS
from opacus_dp.accountants.registry import available_accountants
from opacus_dp.accountants.user_level_calibration import get_user_level_noise_multiplier
from opacus_dp.accountants.validation import (
    MAX_STEPS,
    check_delta,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from opacus_dp.engine.plan import PrivatePlan
from opacus_dp.mechanisms.accounting import reduction_for
from opacus_dp.mechanisms.strategies import KINDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opacus-dp-calculator",
        description="Privacy (epsilon) of DP-SGD with Poisson sampling, or the noise needed for a target epsilon.",
    )
    rate = parser.add_argument_group("sampling (give a sample rate, or batch and dataset size)")
    rate.add_argument("-r", "--sample-rate", "--sampling-rate", dest="sample_rate", type=float)
    rate.add_argument("--batch-size", type=int, help="expected batch size B (sample rate = B / N)")
    rate.add_argument("--dataset-size", type=int, help="number of records N")
    parser.add_argument("-n", "--noise-multiplier", "--sigma", dest="sigma", type=float, help="noise multiplier")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("-e", "--epochs", type=float, help="number of epochs")
    length.add_argument("--steps", type=int, help="number of optimizer steps")
    parser.add_argument("-d", "--delta", type=float, default=1e-5, help="target delta (default: 1e-5)")
    parser.add_argument("-a", "--alphas", type=float, nargs="+", help="RDP orders (implies --accountant rdp)")
    parser.add_argument("--accountant", choices=available_accountants(), help="default: prv (rdp with --alphas)")
    parser.add_argument("--target-epsilon", type=float, help="also report the noise multiplier for this epsilon")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--noise-mechanism", choices=KINDS, default="independent",
                        help="correlated noise (docs/mechanisms.md); default: independent (DP-SGD)")
    parser.add_argument("--bands", type=int, help="bands b of --noise-mechanism banded")
    unit = parser.add_argument_group("privacy unit (docs/user_level.md)")
    unit.add_argument("--privacy-unit", choices=PRIVACY_UNITS, default="example",
                      help="example (default), or user: epsilon per user, by group privacy")
    unit.add_argument("--max-examples-per-user", type=int, metavar="K",
                      help="most examples one user contributes (needed by --privacy-unit user)")
    return parser


def _group_size(args, parser) -> Optional[int]:
    """k of ``--privacy-unit user``; None for example-level privacy."""
    if args.privacy_unit == "example":
        if args.max_examples_per_user is not None:
            parser.error("--max-examples-per-user applies only with --privacy-unit user")
        return None
    if args.max_examples_per_user is None or args.max_examples_per_user < 1:
        parser.error("--privacy-unit user needs --max-examples-per-user K >= 1 (the most examples one user "
                     "contributes)")
    return args.max_examples_per_user


def _accounted(args, parser, q: float, steps: int):
    """``(rate, events)`` the accountant composes: DP-SGD's ``(q, T)``; banded ``(b·q, ⌈T/b⌉)``;
    blt and tree one Gaussian mechanism ``(1, 1)`` (:mod:`opacus_dp.mechanisms.accounting`)."""
    PrivatePlan.check_noise(args.noise_mechanism, args.bands)  # make_private's own check of the two
    if args.noise_mechanism == "independent":
        return q, steps
    if args.noise_mechanism == "banded" and (args.bands is None or args.bands < 1 or args.bands * q > 1 + 1e-12):
        parser.error("--noise-mechanism banded needs --bands b >= 1 with b x sample rate <= 1")
    reduction = reduction_for(args.noise_mechanism, sample_rate=min(1.0, (args.bands or 1) * q), bands=args.bands or 1)
    return reduction.rate, reduction.rounds(steps)


def _sample_rate(args, parser) -> float:
    if args.sample_rate is not None:
        if args.batch_size is not None or args.dataset_size is not None:
            parser.error("give either --sample-rate or --batch-size with --dataset-size, not both")
        return check_sample_rate(args.sample_rate, "--sample-rate")
    if args.batch_size is None or args.dataset_size is None:
        parser.error("give --sample-rate, or both --batch-size and --dataset-size")
    if not 0 < args.batch_size <= args.dataset_size:
        parser.error("--batch-size must lie in [1, --dataset-size]")
    return args.batch_size / args.dataset_size


def _steps(args, parser, q: float) -> int:
    if args.steps is not None:
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        return check_steps(args.steps, "--steps")
    if not (math.isfinite(args.epochs) and args.epochs > 0):
        parser.error("--epochs must be a positive number")
    if q == 0:
        return 0
    per_epoch = -(-args.dataset_size // args.batch_size) if args.sample_rate is None else math.ceil(1 / q)
    steps = math.ceil(args.epochs * per_epoch)
    if steps > MAX_STEPS:
        parser.error(f"--epochs {args.epochs:g} gives more than 2**63 - 1 steps")
    return steps


def compute_report(args, parser) -> dict:
    """All figures of the calculator as a dictionary (``inf`` for an unbounded ε)."""
    q = _sample_rate(args, parser)
    delta = check_delta(args.delta, "--delta")
    steps = _steps(args, parser, q)
    rate, events = _accounted(args, parser, q, steps)
    name = args.accountant or ("rdp" if args.alphas else "prv")
    if args.alphas and name != "rdp":
        parser.error("--alphas only applies to --accountant rdp")
    if args.sigma is None and args.target_epsilon is None:
        parser.error("give --noise-multiplier (to get epsilon) and/or --target-epsilon (to get the noise)")
    group_size = _group_size(args, parser)
    options = {"alphas": args.alphas} if args.alphas else {}
    report = {"sample_rate": q, "steps": steps, "delta": delta, "accountant": name, "upper_bound": name != "gdp",
              "noise_mechanism": args.noise_mechanism, "accounted": [rate, events], "privacy_unit": args.privacy_unit}
    if group_size is not None:
        report["max_examples_per_user"] = group_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.sigma is not None:
            sigma = check_noise_multiplier(args.sigma, "--noise-multiplier")
            report.update(noise_multiplier=args.sigma,
                          **_epsilon_figures(name, (sigma, rate, events), delta, group_size, options))
        if args.target_epsilon is not None:
            report.update(target_epsilon=args.target_epsilon, required_noise_multiplier=_required_noise(
                name, args.target_epsilon, delta, (rate, events), group_size, options))
    return report


def _epsilon_figures(name: str, segment: Tuple[float, float, int], delta: float, group_size: Optional[int],
                     options: dict) -> dict:
    """ε and the best RDP order of the run ``segment = (σ, rate, events)``; per user (group size k),
    also the example-level δ' and ε that the user-level ε comes from."""
    accountant = create_accountant(name)
    accountant.history = [segment]
    if group_size is None:
        epsilon, best_alpha = accountant.get_privacy_spent(delta=delta, **options)
        return {"epsilon": epsilon, "best_alpha": best_alpha}
    epsilon, example_delta = accountant.get_user_level_epsilon(delta, group_size, **options)
    example_epsilon, best_alpha = (accountant.get_privacy_spent(delta=example_delta, **options)
                                   if example_delta > 0 else (math.inf, None))
    return {"epsilon": epsilon, "best_alpha": best_alpha, "example_delta": example_delta,
            "example_epsilon": example_epsilon}


def _required_noise(name: str, target: float, delta: float, accounted: Tuple[float, int],
                    group_size: Optional[int], options: dict) -> float:
    """σ for ``target`` ε per example, or per user with at most ``group_size`` examples."""
    rate, events = accounted
    common = dict(target_epsilon=target, target_delta=delta, sample_rate=rate, steps=events, accountant=name)
    if group_size is None:
        return get_noise_multiplier(**common, **options)
    return get_user_level_noise_multiplier(**common, max_examples_per_user=group_size, **options)


def format_report(report: dict) -> str:
    """Human-readable text of :func:`compute_report`'s dictionary."""
    lines = [f"DP-SGD with sample rate {100 * report['sample_rate']:.4g}% over {report['steps']} steps"]
    if report.get("noise_mechanism", "independent") != "independent":
        rate, events = report["accounted"]
        lines[0] += (f", {report['noise_mechanism']} noise (accounted as {events} Gaussian events at "
                     f"rate {100 * rate:.4g}%)")
    if "epsilon" in report:
        lines.extend(_epsilon_lines(report))
    if not report["upper_bound"]:
        lines.append("Warning: the gdp accountant is a central-limit approximation; epsilon may be under-reported.")
    if "required_noise_multiplier" in report:
        lines.append(
            f"Epsilon {report['target_epsilon']:g} at delta {report['delta']:g}{_per_user(report)} needs a noise "
            f"multiplier of at least {report['required_noise_multiplier']:.6g}."
        )
    return "\n".join(lines)


def _per_user(report: dict) -> str:
    k = report.get("max_examples_per_user")
    return "" if k is None else f" per user contributing at most {k} example{'s' if k > 1 else ''}"


def _epsilon_lines(report: dict) -> List[str]:
    lines = [
        f"and noise multiplier {report['noise_multiplier']} satisfies "
        f"({report['epsilon']:.4g}, {report['delta']:g})-differential privacy{_per_user(report)} "
        f"[{report['accountant']} accountant]."
    ]
    if "example_delta" in report and math.isfinite(report["epsilon"]):
        lines.append(f"By group privacy, from ({report['example_epsilon']:.4g}, {report['example_delta']:.4g})-"
                     "differential privacy per example.")
    if math.isinf(report["epsilon"]):
        lines.append(
            "No finite epsilon holds or could be certified (the privacy loss is too large to "
            "evaluate): use more noise, fewer steps or a smaller sample rate."
        )
    alpha = report.get("best_alpha")
    if alpha is not None and not math.isnan(alpha):
        lines.append(f"The optimal RDP order is {alpha:g}.")
    return lines


def _json_ready(report: dict) -> dict:
    def convert(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None if math.isnan(value) else "inf"
        return value

    return {key: convert(value) for key, value in report.items()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        report = compute_report(args, parser)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    except (ArithmeticError, RuntimeError) as error:  # numerics out of range: a message, no traceback
        parser.error(
            f"the {args.accountant or 'selected'} accountant could not evaluate this run "
            f"({type(error).__name__}: {error}); the privacy loss is too large to compute — use more "
            "noise, fewer steps or a smaller sample rate"
        )
    print(json.dumps(_json_ready(report)) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

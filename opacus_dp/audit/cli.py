"""Command line: ``python -m opacus_dp.audit --noise-multiplier 2.2 --steps 4``.

Runs :func:`~opacus_dp.audit.white_box.run_audit` and prints the accountant's ε next to the
empirical lower bounds and the confidence level (``--json`` for a machine-readable report).
Exit status 1 when the lower bound exceeds the accountant's ε (the privacy claim is refuted).
``--privacy-unit user --canary-examples-per-user M`` audits user-level training with canary users.
"""

import argparse
import json
import sys
from typing import List, Optional

from opacus_dp.audit.config import ACCOUNTANTS, APIS, LOSS_REDUCTIONS, AuditConfig
from opacus_dp.audit.report import format_report, report_to_dict
from opacus_dp.audit.user_canaries import PRIVACY_UNITS, UNIT_GRADIENTS
from opacus_dp.audit.white_box import run_audit


def _threshold(text: str):
    if text in ("model", "split"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threshold must be 'model', 'split' or a number, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m opacus_dp.audit",
        description="Empirical lower bound on epsilon of DP-SGD from white-box canaries.")
    add = parser.add_argument
    add("--noise-multiplier", type=float, required=True, help="sigma of the engine under test")
    add("--steps", type=int, required=True, help="number of DP-SGD steps")
    add("--max-grad-norm", type=float, default=1.0, help="clipping bound C")
    add("--sample-rate", type=float, default=1.0, help="Poisson sampling rate q (1: full batch)")
    add("--canaries-per-run", type=int, default=1000)
    add("--runs", type=int, default=4, help="independent trainings (canaries = runs x per run)")
    add("--background", type=int, default=32, help="background (non-canary) examples per run")
    add("--delta", type=float, default=1e-5)
    add("--confidence", type=float, default=0.95)
    add("--accountant", choices=ACCOUNTANTS, default="prv")
    add("--api", choices=APIS, default="modern")
    add("--grad-sample-mode", default="hooks", help="hooks, functorch, ghost, bk (modern API)")
    add("--loss-reduction", choices=LOSS_REDUCTIONS, default="mean")
    add("--max-physical-batch-size", type=int, default=None, help="virtual steps (BatchMemoryManager)")
    add("--threshold", type=_threshold, default="model", help="'model' (default), 'split' or a number")
    add("--privacy-unit", choices=PRIVACY_UNITS, default="example",
        help="'user': canary users of several examples, trained with make_private(privacy_unit='user')")
    add("--canary-examples-per-user", type=int, default=None, help="examples of each canary user (default 2)")
    add("--max-examples-per-user", type=int, default=None, help="k of make_private (default: no cap)")
    add("--unit-gradient", choices=UNIT_GRADIENTS, default="mean", help="a user's gradient: mean or sum")
    add("--seed", type=int, default=0)
    add("--json", action="store_true", help="print the report as JSON")
    return parser


def config_from_arguments(args: argparse.Namespace) -> AuditConfig:
    return AuditConfig(
        noise_multiplier=args.noise_multiplier, steps=args.steps, max_grad_norm=args.max_grad_norm,
        sample_rate=args.sample_rate, canaries_per_run=args.canaries_per_run, num_runs=args.runs,
        num_background=args.background, delta=args.delta, confidence=args.confidence,
        api=args.api, accountant=args.accountant, grad_sample_mode=args.grad_sample_mode,
        loss_reduction=args.loss_reduction, max_physical_batch_size=args.max_physical_batch_size,
        seed=args.seed, **_unit_arguments(args))


def _unit_arguments(args: argparse.Namespace) -> dict:
    """The user-level fields of the config (none at example level, where the defaults hold)."""
    if args.privacy_unit == "example":
        given = [name for name in ("canary_examples_per_user", "max_examples_per_user")
                 if getattr(args, name) is not None]
        if given or args.unit_gradient != "mean":
            raise ValueError("--canary-examples-per-user, --max-examples-per-user and --unit-gradient apply "
                             "to --privacy-unit user")
        return {}
    m = 2 if args.canary_examples_per_user is None else args.canary_examples_per_user
    return dict(privacy_unit="user", canary_examples_per_user=m,
                max_examples_per_user=args.max_examples_per_user, unit_gradient=args.unit_gradient)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_arguments(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    report = run_audit(config, threshold=args.threshold)
    print(json.dumps(report_to_dict(report), indent=2) if args.json else format_report(report))
    return 1 if report.violates_claim else 0


if __name__ == "__main__":
    sys.exit(main())

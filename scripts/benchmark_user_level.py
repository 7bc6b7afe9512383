#!/usr/bin/env python
"""Utility at equal user-level ε: user-level sampling (ULS) vs example-level sampling (ELS).

Task: ``examples/user_level.py`` — the digits split into 60 writers by a fixed public rule, a
linear classifier, SGD. For every target ε (per writer, at ``--delta``), method and seed the
example trains once with σ calibrated for that ε: ULS with ``make_private_with_epsilon(...,
privacy_unit="user")``, ELS on the first k digits of every writer with σ from
``get_user_level_noise_multiplier`` (group privacy over k). Both use the same q (writers for ULS,
digits for ELS), epochs, k, learning rate and accountant. Prints one markdown table: test
accuracy (mean ± std over the seeds), σ, steps, training digits, and the largest reported ε;
``--out PATH`` also writes it with the command that produced it.

Usage: ``python scripts/benchmark_user_level.py --epsilons 2 4 8 --seeds 3 --out table.md``
"""

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
METHODS = {"ULS": "user", "ELS": "example"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="user-level ε targets")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--sample-rate", type=float, default=0.5)
    parser.add_argument("--max-examples-per-user", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--accountant", default="prv", choices=["prv", "rdp", "gdp"])
    parser.add_argument("--out", help="also write the table and the command to this file")
    return parser.parse_args(argv)


def _example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import user_level

    return user_level


def run_one(args: argparse.Namespace, method: str, epsilon: float, seed: int) -> dict:
    """One training of ``examples/user_level.py`` (its output kept quiet)."""
    example = _example()
    argv = ["--privacy-unit", METHODS[method], "--target-epsilon", str(epsilon), "--delta", str(args.delta),
            "--epochs", str(args.epochs), "--sample-rate", str(args.sample_rate), "--lr", str(args.lr),
            "--max-examples-per-user", str(args.max_examples_per_user), "--accountant", args.accountant,
            "--seed", str(seed)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return example.train(example.parse_args(argv))


def _cell(values) -> str:
    mean = 100 * statistics.fmean(values)
    spread = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {spread:.1f}"


def table(rows) -> str:
    lines = ["| method | target ε per writer | σ | steps | training digits | test accuracy (%) | reported ε (max) |",
             "|---|---|---|---|---|---|---|"]
    for method, epsilon, runs in rows:
        first = runs[0]
        lines.append(f"| {method} | {epsilon:g} | {first['noise_multiplier']:.2f} | {first['steps']} | "
                     f"{first['train_size']} | {_cell([r['test_accuracy'] for r in runs])} | "
                     f"{max(r['epsilon'] for r in runs):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    for epsilon in args.epsilons:
        for method in METHODS:
            runs = [run_one(args, method, epsilon, seed) for seed in range(args.seeds)]
            rows.append((method, epsilon, runs))
            accuracy = _cell([r["test_accuracy"] for r in runs])
            print(f"{method} ε={epsilon:g}: {accuracy} %", file=sys.stderr, flush=True)
    text = table(rows)
    footer = (f"\n\nδ = {args.delta:g} per writer, q = {args.sample_rate:g}, {args.epochs} epochs, "
              f"k = {args.max_examples_per_user}, lr = {args.lr:g}, {args.accountant} accountant, "
              f"{args.seeds} seeds (0..{args.seeds - 1}); {time.perf_counter() - start:.0f} s in all")
    print(text + footer)
    if args.out:
        command = "python scripts/benchmark_user_level.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.out).write_text(f"```bash\n{command.strip()}\n```\n\n{text}{footer}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pin today's training behaviour (updates, gradients, ε) so that a refactor can be shown bitwise-neutral.

    .venv/bin/python scripts/pin_behaviour.py record [--out tests/data/behaviour_pin.json]
    .venv/bin/python scripts/pin_behaviour.py compare [--pin tests/data/behaviour_pin.json]
Record before the change, compare after it: each case of tests/pinning/cases.py prints "bitwise" or
"differs by max |Δ| = …"; the exit status is 1 unless every case is bitwise equal (run with
OMP_NUM_THREADS=1, on the machine that recorded, as tests/pinning/test_behaviour_pin.py does).
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.pinning


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run every case and write the pin file")
    rec.add_argument("--out", default=None, help="the pin file (default tests/data/behaviour_pin.json)")
    cmp = commands.add_parser("compare", help="rerun every case and compare it with the pin file")
    cmp.add_argument("--pin", default=None, help="the pin file (default tests/data/behaviour_pin.json)")
    return parser.parse_args(argv)


def _record(out) -> int:
    from tests.pinning.pin import DEFAULT_PIN, record

    start = time.monotonic()
    pin = record(out or DEFAULT_PIN)
    errors = [name for name, entry in pin["cases"].items() if "error" in entry]
    print(f"recorded {len(pin['cases'])} cases in {time.monotonic() - start:.1f} s to {out or DEFAULT_PIN}")
    for name in errors:
        print(f"  error: {name}: {pin['cases'][name]['error']}")
    return 1 if errors else 0


def _compare(path) -> int:
    from tests.pinning.compare import compare_pins
    from tests.pinning.pin import DEFAULT_PIN, encode_case, fingerprint, load_pin, run_all

    pin = load_pin(path or DEFAULT_PIN)
    if pin["fingerprint"] != fingerprint():
        print(f"note: recorded on {pin['fingerprint']}, running on {fingerprint()}: bitwise equality is not expected")
    start = time.monotonic()
    current = {name: encode_case(ranks) for name, ranks in run_all().items()}
    verdicts = compare_pins(pin["cases"], current, exact=True)
    for verdict in verdicts:
        print(verdict.line())
    failed = [v for v in verdicts if not v.passed_exact]
    print(f"{len(verdicts) - len(failed)} of {len(verdicts)} cases bitwise equal ({time.monotonic() - start:.1f} s)")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = _arguments(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    return _record(args.out) if args.command == "record" else _compare(args.pin)


if __name__ == "__main__":
    sys.exit(main())

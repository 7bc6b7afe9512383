"""Today's training behaviour, pinned: every case of :mod:`tests.pinning.cases` (local, DPDDP and
FSDP2 on 2 gloo processes) must reproduce ``tests/data/behaviour_pin.json`` — bitwise on the machine
fingerprint that recorded it, within the tolerances of :mod:`tests.pinning.compare` elsewhere.
A deliberate change of behaviour is re-recorded with ``scripts/pin_behaviour.py record``."""

import pytest

from tests.pinning.compare import compare_pins
from tests.pinning.pin import encode_case, fingerprint, load_pin, run_all

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_every_pinned_case_reproduces_its_updates_gradients_and_epsilon():
    try:
        pin = load_pin()
    except (FileNotFoundError, ValueError) as error:
        pytest.fail(str(error))
    exact = pin["fingerprint"] == fingerprint()
    current = {name: encode_case(ranks) for name, ranks in run_all().items()}
    verdicts = compare_pins(pin["cases"], current, exact)
    if not exact:
        print(f"recorded on {pin['fingerprint']}, running on {fingerprint()}: compared by tolerance:")
        for verdict in verdicts:
            print("  " + verdict.line())
    failed = [v for v in verdicts if not (v.passed_exact if exact else v.passed_tolerance)]
    assert not failed, (f"{len(failed)} of {len(verdicts)} cases changed "
                        f"({'bitwise' if exact else 'beyond tolerance'}):\n"
                        + "\n".join(v.line() for v in failed)
                        + "\nif the change is intended, re-record: scripts/pin_behaviour.py record")

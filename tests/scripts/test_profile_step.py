"""scripts/profile_step.py: every phase of a private step is timed, and the phases add up to the step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_step.py"


def _own_port() -> dict:
    """This environment without a process group's address: the script binds a free port itself."""
    return {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}


@pytest.mark.slow
def test_phases_add_up_to_the_step():
    done = subprocess.run([sys.executable, str(SCRIPT), "--width", "32", "--layers", "2", "--steps", "2", "--warmup", "1",
                           "--modes", "ddp", "dp-ddp-bk", "fsdp", "dp-fsdp-bk"],
                          capture_output=True, text=True, timeout=300, env=_own_port())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| setting")}
    assert set(rows) == {"ddp", "dp-ddp-bk", "fsdp", "dp-fsdp-bk"}
    for name, cells in rows.items():
        phases, step = [float(c) for c in cells[:8]], float(cells[8])
        assert sum(phases) == pytest.approx(step, abs=0.1 * len(phases))  # rounded to 0.1 ms each
        if name.startswith("dp-"):
            assert phases[2] > 0 and phases[4] > 0  # clip and noise were timed
            assert float(cells[9]) > 0
        else:
            assert phases[2:6] == [0.0, 0.0, 0.0, 0.0] and phases[6] > 0 and cells[9] == "–"

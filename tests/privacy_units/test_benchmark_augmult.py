"""scripts/benchmark_augmult.py: one row per K, every K at the same ε (same σ, q and steps)."""

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_augmult.py"


@pytest.mark.slow
def test_every_multiplicity_is_reported_at_the_same_epsilon(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmark_augmult", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "table.md"
    table = module.main(["--multiplicities", "0,3", "--seeds", "2", "--epochs", "1", "--batch-size", "300",
                         "--epsilon", "2", "--out", str(out)])
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "3"]
    spent = {row.split("|")[4].strip() for row in rows}
    assert len(spent) == 1 and float(spent.pop()) == pytest.approx(2.0, abs=0.02)
    accuracies = [float(row.split("|")[2].split("±")[0]) for row in rows]
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert "Command: `python scripts/benchmark_augmult.py" in out.read_text()

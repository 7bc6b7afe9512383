"""scripts/benchmark_augmult.py: one row per K, every K at the same ε (same σ, q and steps)."""

import re

import pytest

from tests.script_loading import load_script


@pytest.mark.slow
def test_every_multiplicity_is_reported_at_the_same_epsilon(tmp_path):
    module = load_script("benchmark_augmult.py", "benchmark_augmult")
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

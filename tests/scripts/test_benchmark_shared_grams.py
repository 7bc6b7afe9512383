"""scripts/benchmark_shared_grams.py: both variants are timed on the same blocks, the shared one
takes the products of the calls after the first, and both give the same bits."""

import pytest

from tests.script_loading import load_script


def test_shared_and_unshared_steps_are_reported_side_by_side(capsys):
    module = load_script("benchmark_shared_grams.py", "benchmark_shared_grams")
    rows = module.main(["--width", "16", "--positions", "6", "--batch-size", "2",
                        "--repeats", "2", "--warmup", "1", "--clock", "cpu"])
    assert [r["block"] for r in rows] == ["q/k/v", "gate/up"]
    for row, later_calls in zip(rows, (2, 1)):
        assert row["taken"] == later_calls and row["taken_unshared"] == 0
        assert row["same"] is True
        assert row["shared_ms"] > 0 and row["unshared_ms"] > 0
        assert row["ratio"] == pytest.approx(row["unshared_ms"] / row["shared_ms"])
    out = capsys.readouterr().out
    assert "unshared/shared" in out and "gate/up" in out


def test_the_unshared_variant_restores_the_counting():
    module = load_script("benchmark_shared_grams.py", "benchmark_shared_grams")
    original = module.shared_input_grams.SharedInputGrams.expect
    with module.counting(False):
        assert module.shared_input_grams.SharedInputGrams.expect is not original
    assert module.shared_input_grams.SharedInputGrams.expect is original

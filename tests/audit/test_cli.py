"""Command line and script: the accountant's ε next to the lower bound and the confidence level."""

import json
import math
import runpy
import sys
from pathlib import Path

import pytest

from opacus_dp.audit import AuditConfig, run_audit
from opacus_dp.audit.cli import main
from opacus_dp.optim import dp_optimizer

ARGS = ["--noise-multiplier", "2.2", "--steps", "4", "--canaries-per-run", "400", "--runs", "2",
        "--seed", "5", "--confidence", "0.9"]
SAME = AuditConfig(noise_multiplier=2.2, steps=4, canaries_per_run=400, num_runs=2, seed=5, confidence=0.9)


def test_text_report_shows_the_accountant_bound_and_confidence(capsys):
    assert main(ARGS) == 0
    text = capsys.readouterr().out
    expected = run_audit(SAME)
    assert "accountant (prv) epsilon:" in text and f"{expected.accountant_epsilon:.3f}" in text
    assert f"{expected.epsilon_lower_bound:.3f}  <- headline" in text
    assert "at 90% confidence" in text and "consistent" in text


def test_json_report_matches_the_library(capsys):
    assert main(ARGS + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = run_audit(SAME)
    assert data["accountant_epsilon"] == pytest.approx(expected.accountant_epsilon)
    assert data["epsilon_lower_bound"] == pytest.approx(expected.epsilon_lower_bound)
    assert data["confidence"] == 0.9 and data["headline_method"] == "gdp"
    assert data["one_run"]["num_canaries"] == 800 and data["violates_claim"] is False


def test_refuted_claim_exits_with_status_one(monkeypatch, capsys):
    honest = dp_optimizer.noise_std
    monkeypatch.setattr(dp_optimizer, "noise_std", lambda sigma, clipper: honest(sigma, clipper) / 3)
    assert main(ARGS) == 1
    assert "VIOLATION" in capsys.readouterr().out


def test_script_runs_the_same_command(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[2] / "scripts" / "audit.py"
    monkeypatch.setattr(sys, "argv", ["audit.py"] + ARGS + ["--json"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["accountant_epsilon"])


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--noise-multiplier", "1.0", "--steps", "2", "--sample-rate", "2"])
    assert "sample_rate" in capsys.readouterr().err

"""Privacy calculator: flags, text and JSON output, agreement with the accountants."""

import json
import math
import os
import subprocess
import sys
import warnings

import pytest

from opacus_dp.accountants import PRVAccountant, RDPAccountant, get_noise_multiplier
from opacus_dp.cli import main


def run_cli(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_text_output_reports_the_prv_epsilon(capsys):
    out = run_cli(capsys, "-r", "0.01", "-n", "1.0", "--steps", "500", "-d", "1e-5")
    accountant = PRVAccountant()
    accountant.history = [(1.0, 0.01, 500)]
    assert f"({accountant.get_epsilon(1e-5):.4g}, 1e-05)-differential privacy" in out
    assert "500 steps" in out and "prv accountant" in out


def test_json_output_with_batch_and_dataset_size(capsys):
    out = run_cli(capsys, "--batch-size", "256", "--dataset-size", "60000", "--epochs", "2", "--sigma", "1.1", "--json")
    report = json.loads(out)
    q = 256 / 60000
    steps = 2 * 235  # ceil(60000 / 256) batches per epoch
    accountant = PRVAccountant()
    accountant.history = [(1.1, q, steps)]
    assert report["sample_rate"] == q and report["steps"] == steps
    assert report["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert report["best_alpha"] is None and report["upper_bound"] is True


def test_epochs_count_steps_like_the_opacus_script(capsys):
    """epochs × ceil(1/q): 2.5 epochs at q = 0.03 are ceil(2.5 × 34) = 85 steps."""
    report = json.loads(run_cli(capsys, "--json", "-r", "0.03", "-n", "1.0", "-e", "2.5"))
    assert report["steps"] == 85


def test_alphas_select_rdp_like_the_opacus_script(capsys):
    out = run_cli(capsys, "--json", "-r", "0.01", "-n", "1.0", "-e", "3", "-a", "2", "5", "10", "20", "100")
    report = json.loads(out)
    accountant = RDPAccountant(alphas=[2, 5, 10, 20, 100])
    accountant.history = [(1.0, 0.01, 300)]
    eps, alpha = accountant.get_privacy_spent(delta=1e-5)
    assert report["accountant"] == "rdp"
    assert report["epsilon"] == pytest.approx(eps, rel=1e-12) and report["best_alpha"] == alpha


def test_target_epsilon_reports_the_calibrated_noise(capsys):
    out = run_cli(capsys, "--json", "-r", "0.02", "--steps", "400", "--target-epsilon", "2", "--accountant", "rdp")
    report = json.loads(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = get_noise_multiplier(
            target_epsilon=2.0, target_delta=1e-5, sample_rate=0.02, steps=400, accountant="rdp"
        )
    assert report["required_noise_multiplier"] == expected
    assert "epsilon" not in report


def test_gdp_is_flagged_as_an_approximation(capsys):
    out = run_cli(capsys, "-r", "0.01", "-n", "1.0", "--steps", "100", "--accountant", "gdp")
    assert "approximation" in out
    report = json.loads(run_cli(capsys, "--json", "-r", "0.01", "-n", "1.0", "--steps", "100", "--accountant", "gdp"))
    assert report["upper_bound"] is False


def test_no_noise_is_reported_as_infinite(capsys):
    report = json.loads(run_cli(capsys, "--json", "-r", "0.1", "-n", "0", "--steps", "3"))
    assert report["epsilon"] == "inf"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-r", "1.5", "-n", "1", "-e", "1"], "--sample-rate"),
        (["-r", "0.1", "-n", "-1", "-e", "1"], "--noise-multiplier"),
        (["-r", "0.1", "-n", "1", "-e", "1", "-d", "0"], "--delta"),
        (["-r", "0.1", "-n", "1", "-e", "1", "--steps", "3"], "not allowed with"),
        (["-r", "0.1", "-n", "1"], "required"),
        (["-n", "1", "-e", "1"], "--batch-size"),
        (["-r", "0.1", "-e", "1"], "--target-epsilon"),
        (["-r", "0.1", "-n", "1", "-e", "1", "-a", "2", "--accountant", "prv"], "--alphas only"),
        (["-r", "0.1", "-n", "1", "-e", "1", "--accountant", "moments"], "invalid choice"),
        (["-r", "0.1", "-e", "1", "--target-epsilon", "-2"], "target_epsilon"),
        (["-r", "0.1", "-n", "1", "-e", "-1"], "--epochs"),
        (["-r", "0.1", "-n", "1", "--steps", "0"], "--steps"),
    ],
)
def test_bad_flags_exit_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_runs():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "opacus_dp.cli", "-r", "0.01", "-n", "1.0", "--steps", "100", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    assert json.loads(result.stdout)["steps"] == 100


def test_negligible_privacy_loss_reports_the_dp_accounting_epsilon(capsys):
    """σ = 10⁵, q = 10⁻⁵: RDP rounds to ±1e-20 and used to be refused as negative."""
    from .oracles import dp_accounting_rdp_epsilon

    report = json.loads(
        run_cli(capsys, "--json", "-r", "1e-5", "-n", "100000", "--steps", "100", "--accountant", "rdp")
    )
    expected = dp_accounting_rdp_epsilon([(1e5, 1e-5, 100)], 1e-5, RDPAccountant.DEFAULT_ALPHAS)
    assert report["epsilon"] == pytest.approx(expected, abs=1e-12)


def test_gdp_with_tiny_noise_reports_a_huge_epsilon(capsys):
    from .oracles import gdp_epsilon_mp

    report = json.loads(run_cli(capsys, "--json", "-r", "0.01", "-n", "0.05", "--steps", "10", "--accountant", "gdp"))
    mu = 0.01 * (10 * math.expm1(0.05**-2)) ** 0.5
    assert report["epsilon"] == pytest.approx(gdp_epsilon_mp(mu, 1e-5), rel=1e-9)


def test_astronomical_step_count_reports_infinite_epsilon_with_an_explanation(capsys):
    out = run_cli(capsys, "-r", "0.01", "-n", "1", "--steps", str(10**18))
    assert "(inf, 1e-05)-differential privacy" in out and "No finite epsilon" in out


@pytest.mark.parametrize("argv,message", [(["--steps", str(10**21)], "--steps must be at most"),
                                          (["-e", "1e300"], "--epochs 1e+300 gives more than")])
def test_step_counts_beyond_int64_exit_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["-r", "0.01", "-n", "1", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_numerical_failure_exits_with_a_message_not_a_traceback(capsys, monkeypatch):
    """Any arithmetic failure inside an accountant becomes a one-line error (exit code 2)."""
    def overflow(self, delta, **options):
        raise OverflowError("math range error")

    monkeypatch.setattr(PRVAccountant, "get_epsilon", overflow)
    with pytest.raises(SystemExit) as exit_info:
        main(["-r", "0.01", "-n", "1", "--steps", "10"])
    assert exit_info.value.code == 2
    assert "could not evaluate this run (OverflowError: math range error)" in capsys.readouterr().err

"""Calculator with --privacy-unit user: the Python API's figures, calibration, refused flags."""

import json
import math
import warnings

import pytest

from opacus_dp.accountants import PRVAccountant, RDPAccountant
from opacus_dp.accountants.user_level_calibration import get_user_level_noise_multiplier
from opacus_dp.cli import main


def run_cli(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_json_reports_the_user_level_epsilon_of_the_python_api(capsys):
    report = json.loads(run_cli(capsys, "--json", "-r", "0.01", "-n", "1.1", "--steps", "1000", "--accountant", "rdp",
                                "--privacy-unit", "user", "--max-examples-per-user", "4"))
    accountant = RDPAccountant()
    accountant.history = [(1.1, 0.01, 1000)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epsilon, example_delta = accountant.get_user_level_epsilon(1e-5, 4)
        example_epsilon, best_alpha = accountant.get_privacy_spent(delta=example_delta)
    assert report["privacy_unit"] == "user" and report["max_examples_per_user"] == 4
    assert report["epsilon"] == epsilon and report["example_delta"] == example_delta
    assert report["example_epsilon"] == example_epsilon and report["best_alpha"] == best_alpha
    assert report["epsilon"] == 4 * report["example_epsilon"]
    assert report["example_delta"] * sum(math.exp(i * example_epsilon) for i in range(4)) <= 1e-5


def test_text_names_the_user_and_the_example_level_guarantee(capsys):
    out = run_cli(capsys, "-r", "0.01", "-n", "1.1", "--steps", "1000", "--privacy-unit", "user",
                  "--max-examples-per-user", "2")
    accountant = PRVAccountant()
    accountant.history = [(1.1, 0.01, 1000)]
    epsilon, example_delta = accountant.get_user_level_epsilon(1e-5, 2)
    assert (f"({epsilon:.4g}, 1e-05)-differential privacy per user contributing at most 2 examples "
            "[prv accountant]") in out
    assert f"from ({epsilon / 2:.4g}, {example_delta:.4g})-differential privacy per example" in out


def test_example_unit_is_the_default_and_k_one_agrees(capsys):
    argv = ["--json", "-r", "0.02", "-n", "1.0", "--steps", "300", "--accountant", "rdp"]
    example = json.loads(run_cli(capsys, *argv))
    user = json.loads(run_cli(capsys, *argv, "--privacy-unit", "user", "--max-examples-per-user", "1"))
    assert example["privacy_unit"] == "example" and "example_delta" not in example
    assert user["epsilon"] == example["epsilon"] and user["example_delta"] == 1e-5


def test_target_epsilon_calibrates_the_user_level_noise(capsys):
    report = json.loads(run_cli(capsys, "--json", "-r", "0.02", "--steps", "400", "--target-epsilon", "4",
                                "--accountant", "rdp", "--privacy-unit", "user", "--max-examples-per-user", "3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = get_user_level_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, max_examples_per_user=3,
                                                   sample_rate=0.02, steps=400, accountant="rdp")
    assert report["required_noise_multiplier"] == expected
    check = json.loads(run_cli(capsys, "--json", "-r", "0.02", "--steps", "400", "-n", repr(expected),
                               "--accountant", "rdp", "--privacy-unit", "user", "--max-examples-per-user", "3"))
    assert 3.96 <= check["epsilon"] <= 4.0


def test_target_epsilon_text_names_the_user(capsys):
    out = run_cli(capsys, "-r", "0.02", "--steps", "400", "--target-epsilon", "4", "--accountant", "rdp",
                  "--privacy-unit", "user", "--max-examples-per-user", "3")
    assert "Epsilon 4 at delta 1e-05 per user contributing at most 3 examples needs a noise multiplier" in out


def test_no_noise_per_user_is_infinite(capsys):
    report = json.loads(run_cli(capsys, "--json", "-r", "0.1", "-n", "0", "--steps", "3", "--privacy-unit", "user",
                                "--max-examples-per-user", "2"))
    assert report["epsilon"] == "inf" and report["example_delta"] == 0.0


@pytest.mark.parametrize("extra,message", [
    (["--max-examples-per-user", "3"], "--max-examples-per-user applies only with --privacy-unit user"),
    (["--privacy-unit", "user"], "--privacy-unit user needs --max-examples-per-user"),
    (["--privacy-unit", "user", "--max-examples-per-user", "0"], "--max-examples-per-user K >= 1"),
    (["--privacy-unit", "user", "--max-examples-per-user", "2.5"], "invalid int value"),
    (["--privacy-unit", "users"], "invalid choice"),
])
def test_bad_privacy_unit_flags_exit_with_a_message(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["-r", "0.01", "-n", "1", "--steps", "10", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

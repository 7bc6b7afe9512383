"""The quickstart reaches its advertised accuracy at its advertised ε on the shipped digits."""

import pytest

from tests.examples.example_runs import (
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    read_json,
    run_example,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SECURE_MODE_WARNING)]

TRAIN_SIZE = 1437  # 80 % of sklearn's 1,797 digits


def test_quickstart_reaches_85_percent_at_epsilon_3(tmp_path, capsys):
    summary_path = tmp_path / "quickstart.json"
    out = run_example("quickstart", ["--json", summary_path], capsys)
    summary = read_json(summary_path)
    assert summary["train_size"] == TRAIN_SIZE and summary["test_size"] == 1797 - TRAIN_SIZE
    assert summary["test_accuracy"] >= 0.85, out
    # A batch size of 512 over 1,437 examples gives ceil(1437/512) = 3 batches per epoch, so
    # q = 1/3 and 20 epochs are 60 steps, all with the calibrated σ.
    assert_history(summary, sigma=summary["noise_multiplier"], sample_rate=1 / 3, steps=60)
    epsilon = assert_epsilon_consistent(out, summary)
    assert epsilon <= 3.0
    assert f"test accuracy = {100 * summary['test_accuracy']:.2f} %" in out


def test_quickstart_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_example("quickstart", ["--epochs", "0"], capsys)
    assert exit_info.value.code == 2
    assert "--epochs" in capsys.readouterr().err

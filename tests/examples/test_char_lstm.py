"""End-to-end runs of examples/char_lstm.py on a tiny names dataset (<Language>.txt files)."""

import pytest
import torch

from tests.examples.fake_data import NAMES, write_names
from tests.examples.example_runs import (
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    example_module,
    load_checkpoint,
    read_json,
    run_example,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SECURE_MODE_WARNING)]

SIGMA = 1.0
TOTAL = sum(len(v) for v in NAMES.values())  # 48 names, 10 of them (20 %) held out
TRAIN = TOTAL - round(0.2 * TOTAL)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return write_names(str(tmp_path_factory.mktemp("names")))


def _argv(data_root, out, *extra, epochs=1):
    return ["--data-root", data_root, "--epochs", epochs, "--hidden-size", 8, "--embedding-size", 8,
            "--sigma", SIGMA, "--checkpoint-file", out / "lstm.pt", "--metrics-file", out / "lstm.json",
            "--no-progress", *extra]


def test_encoding_uses_a_fixed_alphabet():
    lstm = example_module("char_lstm")
    assert lstm.to_ascii("Šimůnek") == "Simunek"
    encoded = lstm.encode("Abe", 5)
    expected = [lstm.PAD, lstm.PAD] + [2 + lstm.ALPHABET.index(c) for c in "Abe"]
    assert encoded.tolist() == expected
    assert lstm.encode("Zoë?", 3).tolist() == [2 + lstm.ALPHABET.index("o"), 2 + lstm.ALPHABET.index("e"),
                                               lstm.UNKNOWN]


def test_one_epoch_then_resume(data_root, tmp_path, capsys):
    # B = 19 of 38 training names: q = 1/2, 2 steps per epoch.
    run_example("char_lstm", _argv(data_root, tmp_path, "--batch-size", 19), capsys)
    out = run_example("char_lstm", _argv(data_root, tmp_path, "--batch-size", 19, "--resume",
                                         tmp_path / "lstm.pt", epochs=2), capsys)
    assert f"3 languages, {TRAIN} training and {TOTAL - TRAIN} test names" in out
    metrics = read_json(tmp_path / "lstm.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=19 / TRAIN, steps=4)
    assert_epsilon_consistent(out, metrics["privacy"])
    lstm = example_module("char_lstm")
    model = lstm.CharLSTMClassifier(3, embedding_size=8, hidden_size=8)
    model.load_state_dict(load_checkpoint(tmp_path / "lstm.pt")["module_state_dict"])
    assert model(torch.stack([lstm.encode("Rossi", 15)])).shape == (1, 3)


def test_missing_data_says_where_it_looked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_example("char_lstm", ["--data-root", tmp_path, "--no-progress"], capsys)
    assert exit_info.value.code == 2
    assert "<Language>.txt" in capsys.readouterr().err


"""End-to-end runs of examples/mnist.py on tiny MNIST idx files (torchvision's raw layout)."""

import pytest
import torch

from tests.examples.fake_data import write_mnist
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


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return write_mnist(str(tmp_path_factory.mktemp("mnist")), train_size=48, test_size=16)


def _argv(data_root, out, *extra, epochs=1):
    return ["--data-root", data_root, "--epochs", epochs, "--width", 4, "--sigma", SIGMA,
            "--checkpoint-file", out / "mnist.pt", "--metrics-file", out / "mnist.json",
            "--no-progress", *extra]


def test_one_epoch_then_resume(data_root, tmp_path, capsys):
    # B = 12 of 48: q = 1/4, 4 steps per epoch; the resumed epoch continues the history.
    run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 12), capsys)
    first = read_json(tmp_path / "mnist.json")
    assert_history(first["privacy"], sigma=SIGMA, sample_rate=0.25, steps=4)
    out = run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 12, "--resume",
                                     tmp_path / "mnist.pt", epochs=2), capsys)
    metrics = read_json(tmp_path / "mnist.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=0.25, steps=8)
    assert assert_epsilon_consistent(out, metrics["privacy"]) > first["epsilon"]
    model = example_module("mnist").sample_convnet(width=4)
    model.load_state_dict(load_checkpoint(tmp_path / "mnist_best.pt")["module_state_dict"])


def test_calibrated_sigma_meets_the_target(data_root, tmp_path, capsys):
    out = run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 12, "--target-epsilon", 4,
                                     "--api", "classic"), capsys)
    privacy = read_json(tmp_path / "mnist.json")["privacy"]
    assert privacy["accountant"] == "rdp" and privacy["noise_multiplier"] != SIGMA
    epsilon = assert_epsilon_consistent(out, privacy, reference_rtol=1e-6)
    assert 4 * 0.97 <= epsilon <= 4


def _weights(path):
    return load_checkpoint(path)["module_state_dict"]


def test_per_sample_gradient_routes_agree(data_root, tmp_path, capsys):
    """Hooks, the torch.func fallback, book-keeping and nn.DataParallel give the same private
    training; so do the classic API's hooks and book-keeping (its --grad-sample-mode is used)."""
    runs = {"hooks": [], "functorch": ["--grad-sample-mode", "functorch"], "bk": ["--grad-sample-mode", "bk"],
            "data_parallel": ["--data-parallel"], "classic": ["--api", "classic"],
            "classic_bk": ["--api", "classic", "--grad-sample-mode", "bk"]}
    for name, extra in runs.items():
        run_example("mnist", _argv(data_root, tmp_path / name, "--batch-size", 12, *extra), capsys)
    for name, mode in (("classic", "hooks"), ("classic_bk", "bk"), ("bk", "bk")):
        assert read_json(tmp_path / name / "mnist.json")["privacy"]["grad_sample_mode"] == mode
    classic = _weights(tmp_path / "classic" / "mnist.pt")
    for key, value in _weights(tmp_path / "classic_bk" / "mnist.pt").items():
        assert torch.allclose(value, classic[key], rtol=0, atol=1e-5), ("classic_bk", key)
    reference = _weights(tmp_path / "hooks" / "mnist.pt")
    for name in ("functorch", "bk", "data_parallel"):
        weights = _weights(tmp_path / name / "mnist.pt")
        for key, value in reference.items():
            assert torch.allclose(weights[key], value, rtol=0, atol=1e-5), (name, key)


def test_evaluate_reports_the_checkpoint_accuracy(data_root, tmp_path, capsys):
    run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 12), capsys)
    accuracy = read_json(tmp_path / "mnist.json")["test_accuracy"]
    argv = _argv(data_root, tmp_path, "--resume", tmp_path / "mnist.pt", "--evaluate")
    out = run_example("mnist", argv, capsys)
    assert f"test accuracy = {100 * accuracy:.2f} %" in out


def test_without_privacy_and_with_secure_randomness(data_root, tmp_path, capsys):
    out = run_example("mnist", _argv(data_root, tmp_path / "plain", "--disable-dp"), capsys)
    assert "ε =" not in out
    assert read_json(tmp_path / "plain" / "mnist.json")["privacy"] == {"private": False}
    argv = _argv(data_root, tmp_path / "secure", "--batch-size", 12, "--secure-rng")
    out = run_example("mnist", argv, capsys)
    privacy = read_json(tmp_path / "secure" / "mnist.json")["privacy"]
    assert_history(privacy, sigma=SIGMA, sample_rate=0.25, steps=4)
    assert_epsilon_consistent(out, privacy)


def test_missing_data_says_where_it_looked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_example("mnist", ["--data-root", tmp_path, "--no-progress"], capsys)
    assert exit_info.value.code == 2
    assert str(tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte") in capsys.readouterr().err


def test_ghost_mode_is_refused_by_the_examples_with_the_alternative(data_root, tmp_path, capsys):
    """The examples' loops cannot use the ghost criterion's two-pass backward: the flag is
    refused by the argument parser, whose help names bk instead."""
    with pytest.raises(SystemExit) as exit_info:
        run_example("mnist", _argv(data_root, tmp_path, "--grad-sample-mode", "ghost"), capsys)
    assert exit_info.value.code == 2
    assert "invalid choice: 'ghost'" in capsys.readouterr().err


@pytest.mark.parametrize("api", ["modern", "classic"])
def test_epoch_steps_count_private_steps_when_batches_are_split(data_root, tmp_path, capsys, api):
    """B = 4 × 2 accumulation steps = 8 of 48 per step: 6 private steps per epoch, however many
    memory pieces each Poisson batch was cut into (the modern loop counted every piece)."""
    run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 4, "--n-accumulation-steps", 2,
                               "--api", api, epochs=2), capsys)
    metrics = read_json(tmp_path / "mnist.json")
    assert [e["steps"] for e in metrics["epochs"]] == [6, 6]
    assert [e["total_steps"] for e in metrics["epochs"]] == [6, 12]
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=8 / 48, steps=12)


def test_resume_keeps_the_checkpoints_sigma_and_says_so(data_root, tmp_path, capsys):
    """A resumed run continues its privacy history with its σ: another --sigma is reported as not
    applied, and the metrics file records the σ used (it recorded the ignored flag)."""
    run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 12), capsys)
    argv = _argv(data_root, tmp_path, "--batch-size", 12, "--resume", tmp_path / "mnist.pt", epochs=2)
    argv[argv.index("--sigma") + 1] = 3.0
    out = run_example("mnist", argv, capsys)
    assert "resuming with the checkpoint's noise multiplier σ = 1" in out
    metrics = read_json(tmp_path / "mnist.json")
    assert metrics["settings"]["sigma"] == SIGMA
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=0.25, steps=8)


@pytest.mark.parametrize("flag, value", [("--sigma", -1), ("--sigma", "nan"), ("--delta", 0), ("--delta", 1.5),
                                         ("--target-epsilon", -1), ("--max-epsilon", 0), ("--workers", -1),
                                         ("--lr", "inf"), ("--device", "foo")])
def test_out_of_range_flags_are_argparse_errors_naming_the_flag(data_root, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        example_module("mnist").main([str(a) for a in _argv(data_root, tmp_path, flag, value)])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


class _RunsCode:
    """Unpickling this creates ``marker``: the side effect a malicious checkpoint would have."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return (os.makedirs, (self.marker,))


@pytest.mark.parametrize("api", ["modern", "classic"])
def test_resume_from_a_malicious_checkpoint_runs_nothing(data_root, tmp_path, capsys, api):
    marker = tmp_path / "ran"
    torch.save({"api": api, "epoch": 1, "x": _RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(SystemExit, match="safe loader refuses"):
        run_example("mnist", _argv(data_root, tmp_path, "--batch-size", 12, "--api", api,
                                   "--resume", tmp_path / "evil.pt"), capsys)
    assert not marker.exists()

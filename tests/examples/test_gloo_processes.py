"""MNIST, names (DPLSTM) and DCGAN examples across 2 gloo processes (DPDDP), one launch.

The two processes get torchrun's environment and run the three examples one after another
(each with its own process group), so torch is imported twice instead of six times. The
torchrun launcher itself is exercised by the CIFAR-10 test.
"""

import pytest

from tests.examples.fake_data import NAMES, write_mnist, write_names
from tests.examples.example_runs import (
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    example_module,
    load_checkpoint,
    read_json,
    run_in_processes,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.filterwarnings(SECURE_MODE_WARNING)]

SIGMA = 1.0
NAMES_TRAIN = sum(len(v) for v in NAMES.values()) - 10  # 20 % of 48 names held out
DIGIT_3_IMAGES = 183  # images of the digit 3 in scikit-learn's digits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gloo")
    mnist_root, names_root = write_mnist(str(base / "mnist"), train_size=48), write_names(str(base / "names"))
    common = ["--epochs", 1, "--sigma", SIGMA, "--no-progress"]
    plan = [
        # classic API: q = 2 processes × 6 / 48 = 1/4, 4 steps, RDP accounting
        ("mnist", [*common, "--data-root", mnist_root, "--width", 4, "--batch-size", 6, "--api", "classic",
                   "--checkpoint-file", base / "mnist.pt", "--metrics-file", base / "mnist.json"]),
        # q = 2 × 10 / 38, round(1/q) = 2 steps
        ("char_lstm", [*common, "--data-root", names_root, "--hidden-size", 8, "--embedding-size", 8,
                       "--batch-size", 10, "--checkpoint-file", base / "lstm.pt",
                       "--metrics-file", base / "lstm.json"]),
        # q = 2 × 30 / 183, round(1/q) = 3 steps; 30 fake rows per process and step
        ("dcgan", [*common, "--dataset", "digits", "--target-digit", 3, "--batch-size", 30,
                   "--image-size", 8, "--ngf", 4, "--ndf", 4, "--nz", 8, "--outf", base / "gan",
                   "--metrics-file", base / "gan.json"]),
    ]
    return base, run_in_processes(plan, base)


def test_mnist_classic_api(runs):
    base, outputs = runs
    metrics = read_json(base / "mnist.json")
    assert metrics["world_size"] == 2 and metrics["privacy"]["api"] == "classic"
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=0.25, steps=4)
    assert_epsilon_consistent(outputs["mnist"], metrics["privacy"], reference_rtol=1e-6)
    model = example_module("mnist").sample_convnet(width=4)
    model.load_state_dict(load_checkpoint(base / "mnist.pt")["module_state_dict"])


def test_char_lstm(runs):
    base, outputs = runs
    metrics = read_json(base / "lstm.json")
    assert metrics["world_size"] == 2
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=20 / NAMES_TRAIN, steps=2)
    assert_epsilon_consistent(outputs["char_lstm"], metrics["privacy"])
    model = example_module("char_lstm").CharLSTMClassifier(3, embedding_size=8, hidden_size=8)
    model.load_state_dict(load_checkpoint(base / "lstm.pt")["module_state_dict"])


def test_dcgan(runs):
    base, outputs = runs
    metrics = read_json(base / "gan.json")
    assert metrics["world_size"] == 2 and metrics["fake_rows"] == 30
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=60 / DIGIT_3_IMAGES, steps=3)
    assert_epsilon_consistent(outputs["dcgan"], metrics["privacy"])
    assert (base / "gan" / "real_samples.png").is_file()
    assert (base / "gan" / "fake_samples_epoch_001.png").is_file()
    assert load_checkpoint(base / "gan" / "dcgan.pt")["epoch"] == 1

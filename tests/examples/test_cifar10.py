"""End-to-end runs of examples/cifar10.py on a tiny CIFAR-10 copy in the real pickle format."""

import math

import pytest
import torch

from tests.examples.fake_data import write_cifar10
from tests.examples.example_runs import (
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    example_module,
    load_checkpoint,
    read_json,
    recomputed_epsilon,
    run_example,
    run_torchrun,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SECURE_MODE_WARNING)]

TRAIN_SIZE = 40  # 5 batches × 8 images
SIGMA = 1.5


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return write_cifar10(str(tmp_path_factory.mktemp("cifar")), per_batch=8, test_size=16)


def _argv(data_root, out, *extra, epochs=1, name="run"):
    return ["--data-root", data_root, "--epochs", epochs, "--width", 4, "--sigma", SIGMA,
            "--checkpoint-file", out / f"{name}.pt", "--metrics-file", out / f"{name}.json",
            "--no-progress", *extra]


def _weights(path):
    return load_checkpoint(path)["module_state_dict"]


def _assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=atol), key


def test_resume_continues_the_run_exactly(data_root, tmp_path, capsys):
    argv = ["--batch-size", 8]  # q = 8/40 = 0.2, round(1/q) = 5 steps per epoch
    run_example("cifar10", _argv(data_root, tmp_path, *argv, name="part"), capsys)
    first = read_json(tmp_path / "part.json")
    out = run_example("cifar10", _argv(data_root, tmp_path, *argv, "--resume", tmp_path / "part.pt",
                                       epochs=2, name="part"), capsys)
    resumed = read_json(tmp_path / "part.json")
    run_example("cifar10", _argv(data_root, tmp_path, *argv, epochs=2, name="whole"), capsys)

    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2]
    assert_history(resumed["privacy"], sigma=SIGMA, sample_rate=0.2, steps=10)
    epsilon = assert_epsilon_consistent(out, resumed["privacy"])
    assert epsilon > first["epsilon"]
    # Model, optimizer, privacy history and both generators were restored: the resumed run
    # is the uninterrupted one, bit for bit.
    _assert_same_weights(_weights(tmp_path / "part.pt"), _weights(tmp_path / "whole.pt"))
    assert read_json(tmp_path / "whole.json")["epsilon"] == pytest.approx(epsilon, abs=1e-6)


def test_checkpoints_load_into_a_plain_model(data_root, tmp_path, capsys):
    run_example("cifar10", _argv(data_root, tmp_path, "--batch-size", 8, epochs=2), capsys)
    metrics = read_json(tmp_path / "run.json")
    cifar10 = example_module("cifar10")
    from common import vision_data  # importable once the example module is loaded
    from common.loop import evaluate

    test = torch.utils.data.DataLoader(vision_data.cifar10(data_root, download=False, train=False),
                                       batch_size=64)
    for path, accuracy in ((tmp_path / "run.pt", metrics["epochs"][-1]["test_accuracy"]),
                           (tmp_path / "run_best.pt", metrics["best_accuracy"])):
        model = cifar10.tanh_convnet(width=4)
        model.load_state_dict(load_checkpoint(path)["module_state_dict"])  # no wrapper prefixes
        assert evaluate(model, test, torch.device("cpu"))["accuracy"] == pytest.approx(accuracy)


@pytest.mark.parametrize("api", ["modern", "classic"])
def test_accumulation_only_changes_physical_batches(data_root, tmp_path, capsys, api):
    """k physical batches of ≤ B per step == one batch per step (same Poisson batches, same noise).

    With torch's own convolutions: oneDNN's, on some CPUs (AVX2 x86), round differently for
    batches of 4 and of 8, and five steps at lr 0.5 amplify that to ~1e-3 in the first layer's
    weights (1.5e-6 with torch's)."""
    common = ["--api", api, "--architecture", "resnet", "--depth", 8, "--optim", "SGD", "--lr", 0.5]
    onednn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        out = run_example("cifar10", _argv(data_root, tmp_path, *common, "--batch-size", 4,
                                           "--n-accumulation-steps", 2, name="split"), capsys)
        run_example("cifar10", _argv(data_root, tmp_path, *common, "--batch-size", 8, name="single"), capsys)
    finally:
        torch.backends.mkldnn.enabled = onednn
    privacy = read_json(tmp_path / "split.json")["privacy"]
    assert privacy["accountant"] == ("rdp" if api == "classic" else "prv")
    assert_history(privacy, sigma=SIGMA, sample_rate=0.2, steps=5)
    assert_epsilon_consistent(out, privacy, reference_rtol=1e-6 if api == "classic" else 0.02)
    _assert_same_weights(_weights(tmp_path / "split.pt"), _weights(tmp_path / "single.pt"), atol=1e-5)


def test_privacy_budget_stops_cleanly(data_root, tmp_path, capsys):
    max_epsilon = 2.0
    out = run_example("cifar10", _argv(data_root, tmp_path, "--batch-size", 8, "--max-epsilon",
                                       max_epsilon, epochs=5), capsys)
    metrics = read_json(tmp_path / "run.json")
    assert "stopping: privacy budget" in out and metrics["stopped"] == "privacy budget"
    privacy = metrics["privacy"]
    epsilon = assert_epsilon_consistent(out, privacy)
    assert epsilon <= max_epsilon
    # Not stopped too early: one more step of the same kind would have exceeded the budget.
    sigma, q, steps = privacy["history"][-1]
    longer = dict(privacy, history=privacy["history"][:-1] + [[sigma, q, steps + 1]])
    assert recomputed_epsilon(longer) > max_epsilon
    saved = load_checkpoint(tmp_path / "run.pt")
    assert saved["privacy"]["history"] == privacy["history"]


def test_missing_data_says_where_it_looked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_example("cifar10", ["--data-root", tmp_path / "nowhere", "--no-progress"], capsys)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py" / "data_batch_1") in err
    assert "--download" in err


@pytest.mark.distributed
def test_two_processes_under_torchrun(data_root, tmp_path):
    # 2 processes × B=4 expected per process: q = 8/40 = 0.2, 5 steps of the global batch.
    out = run_torchrun("cifar10", _argv(data_root, tmp_path, "--batch-size", 4))
    metrics = read_json(tmp_path / "run.json")
    assert metrics["world_size"] == 2
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=0.2, steps=5)
    assert_epsilon_consistent(out, metrics["privacy"])
    assert math.isfinite(metrics["epochs"][0]["train_loss"])
    model = example_module("cifar10").tanh_convnet(width=4)
    model.load_state_dict(_weights(tmp_path / "run.pt"))


def test_fast_noise_philox_resumes_exactly_and_its_checkpoint_refuses_another_generator(data_root, tmp_path,
                                                                                        capsys):
    argv = ["--batch-size", 8, "--fast-noise", "philox"]
    run_example("cifar10", _argv(data_root, tmp_path, *argv, name="part"), capsys)
    run_example("cifar10", _argv(data_root, tmp_path, *argv, "--resume", tmp_path / "part.pt",
                                 epochs=2, name="part"), capsys)
    run_example("cifar10", _argv(data_root, tmp_path, *argv, epochs=2, name="whole"), capsys)
    _assert_same_weights(_weights(tmp_path / "part.pt"), _weights(tmp_path / "whole.pt"))
    run_example("cifar10", _argv(data_root, tmp_path, "--batch-size", 8, epochs=2, name="default"), capsys)
    philox, default = _weights(tmp_path / "whole.pt"), _weights(tmp_path / "default.pt")
    assert any(not torch.equal(philox[key], default[key]) for key in philox)  # another noise stream
    with pytest.raises(ValueError, match="saved with fast_noise='philox'"):
        run_example("cifar10", _argv(data_root, tmp_path, "--batch-size", 8, "--resume", tmp_path / "whole.pt",
                                     epochs=3, name="other"), capsys)

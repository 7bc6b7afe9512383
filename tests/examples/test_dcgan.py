"""End-to-end runs of examples/dcgan.py (private discriminator, non-private generator)."""

import pytest
import torch
from PIL import Image

from tests.examples.fake_data import write_cifar10, write_image_folder, write_mnist
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
TINY = ["--image-size", 8, "--ngf", 4, "--ndf", 4, "--nz", 8, "--sigma", SIGMA, "--no-progress"]


def _argv(out, *extra, epochs=1):
    return [*TINY, "--epochs", epochs, "--outf", out, "--metrics-file", out / "metrics.json", *extra]


def _grid_size(images, side=8, per_row=8, padding=2):
    """Size of torchvision's ``save_image`` grid of ``images`` squares."""
    columns, rows = min(per_row, images), -(-images // per_row)
    return columns * (side + padding) + padding, rows * (side + padding) + padding


def _assert_grids(out, epochs, real_images=64):
    with Image.open(out / "real_samples.png") as real:
        assert real.size == _grid_size(real_images)
    for epoch in range(1, epochs + 1):
        with Image.open(out / f"fake_samples_epoch_{epoch:03d}.png") as fake:
            fake.load()
            assert fake.size == _grid_size(64)


def test_digits_resume_is_exact_and_outputs_load(tmp_path, capsys):
    # digit 3 of sklearn's digits: 183 images; B = 61 gives q = 1/3 and 3 steps per epoch.
    argv = ["--dataset", "digits", "--target-digit", 3, "--batch-size", 61]
    run_example("dcgan", _argv(tmp_path / "part", *argv), capsys)
    out = run_example("dcgan", _argv(tmp_path / "part", *argv, "--resume",
                                     tmp_path / "part" / "dcgan.pt", epochs=2), capsys)
    run_example("dcgan", _argv(tmp_path / "whole", *argv, epochs=2), capsys)
    metrics = read_json(tmp_path / "part" / "metrics.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert metrics["fake_rows"] == 61  # fixed: the expected real batch, not the drawn one
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=61 / 183, steps=6)
    assert_epsilon_consistent(out, metrics["privacy"])
    _assert_grids(tmp_path / "part", epochs=2)
    part = load_checkpoint(tmp_path / "part" / "dcgan.pt")
    whole = load_checkpoint(tmp_path / "whole" / "dcgan.pt")
    for key in ("module_state_dict", "generator_state_dict"):
        for name, value in part[key].items():
            assert torch.equal(value, whole[key][name]), (key, name)
    gan = example_module("dcgan")
    netG, netD = gan.Generator(8, 4, 1, 8), gan.Discriminator(4, 1, 8)
    netG.load_state_dict(part["generator_state_dict"])
    netD.load_state_dict(part["module_state_dict"])


@pytest.mark.parametrize("dataset", ["fake", "folder", "mnist", "cifar10"])
def test_other_datasets_one_epoch(tmp_path, capsys, dataset):
    root = tmp_path / "data"
    extra = {"fake": lambda: ["--fake-size", 16],
             "folder": lambda: ["--data-root", write_image_folder(str(root), classes=2, per_class=8)],
             "mnist": lambda: ["--data-root", write_mnist(str(root), train_size=48), "--target-digit", 3],
             "cifar10": lambda: ["--data-root", write_cifar10(str(root), per_batch=4)]}[dataset]()
    argv = _argv(tmp_path / "out", "--dataset", dataset, "--batch-size", 4, *extra)
    out = run_example("dcgan", argv, capsys)
    metrics = read_json(tmp_path / "out" / "metrics.json")
    assert_epsilon_consistent(out, metrics["privacy"])
    _assert_grids(tmp_path / "out", epochs=1, real_images=min(64, metrics["dataset_size"]))
    assert load_checkpoint(tmp_path / "out" / "dcgan.pt")["epoch"] == 1


def test_generator_step_leaves_no_discriminator_state():
    """Inside ``discriminator_frozen`` a backward reaches G only: no grad, no per-sample grad in D."""
    from opacus_dp.grad_sample import GradSampleModule

    gan = example_module("dcgan")
    from common.gan import discriminator_frozen

    netG, netD = gan.Generator(8, 4, 1, 8), GradSampleModule(gan.Discriminator(4, 1, 8))
    with discriminator_frozen(netD):
        netD(netG(torch.randn(5, 8, 1, 1))).sum().backward()
    for p in netD.parameters():
        assert p.requires_grad and p.grad is None and getattr(p, "grad_sample", None) is None
    assert all(p.grad is not None for p in netG.parameters())
    netD(torch.randn(3, 1, 8, 8)).sum().backward()  # hooks are back on afterwards
    assert all(p.grad_sample.shape[0] == 3 for p in netD.parameters())


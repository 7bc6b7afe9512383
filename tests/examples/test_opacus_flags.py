"""Opacus's example flags, ``--help`` defaults, ε in the progress bars, ``--synthetic`` data and
an offline ``--download``: what a user of Opacus's own example scripts expects."""

import argparse
import re
import socket

import pytest
import torch

from tests.examples.example_runs import SECURE_MODE_WARNING, example_module, read_json, run_example

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SECURE_MODE_WARNING)]

# every flag of Opacus 1.6's examples/cifar10.py (parse_args), with a value of its type
OPACUS_CIFAR10_FLAGS = [
    ("--grad_sample_mode", "functorch"), ("-j", "3"), ("--workers", "3"), ("--epochs", "4"),
    ("--start-epoch", "2"), ("-b", "64"), ("--batch-size-test", "64"), ("--batch-size", "32"),
    ("--lr", "0.5"), ("--learning-rate", "0.5"), ("--momentum", "0.5"), ("--wd", "0.01"),
    ("--weight-decay", "0.01"), ("-p", "5"), ("--print-freq", "5"), ("--resume", "run.pt"),
    ("-e", None), ("--evaluate", None), ("--seed", "3"), ("--sigma", "1.1"), ("-c", "2.0"),
    ("--max-per-sample-grad_norm", "2.0"), ("--disable-dp", None), ("--secure-rng", None),
    ("--delta", "1e-6"), ("--checkpoint-file", "run.pt"), ("--data-root", "data"), ("--log-dir", "logs"),
    ("--optim", "SGD"), ("--lr-schedule", "cos"), ("--device", "cpu"), ("--local_rank", "0"),
    ("--dist_backend", "gloo"), ("--clip_per_layer", None), ("--debug", "0"),
]
EXPECTED = dict(grad_sample_mode="functorch", workers=3, epochs=4, start_epoch=2, batch_size_test=64,
                batch_size=32, lr=0.5, momentum=0.5, weight_decay=0.01, print_freq=5, resume="run.pt",
                evaluate=True, seed=3, sigma=1.1, max_grad_norm=2.0, disable_dp=True, secure_rng=True,
                delta=1e-6, checkpoint_file="run.pt", data_root="data", tensorboard="logs", optim="SGD",
                lr_schedule="cos", device="cpu", local_rank=0, dist_backend="gloo", clip_per_layer=True, debug=0)


@pytest.mark.parametrize("flag, value", OPACUS_CIFAR10_FLAGS, ids=[f for f, _ in OPACUS_CIFAR10_FLAGS])
def test_cifar10_accepts_each_flag_of_opacus_cifar10(flag, value):
    argv = [flag] + ([value] if value is not None else [])
    if flag in ("-e", "--evaluate"):
        argv += ["--resume", "run.pt"]
    example_module("cifar10").parse_args(argv)


def test_cifar10_flags_of_opacus_keep_their_meaning():
    argv = [item for flag, value in OPACUS_CIFAR10_FLAGS for item in (flag, value) if item is not None]
    args = example_module("cifar10").parse_args(argv + ["--n_accumulation_steps", "2"])
    assert {name: getattr(args, name) for name in EXPECTED} == EXPECTED
    assert args.n_accumulation_steps == 2


@pytest.mark.parametrize("name", ["cifar10", "mnist", "char_lstm", "dcgan", "quickstart"])
def test_help_shows_the_defaults(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example_module(name).parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "(default: " in text and "--seed" in text


def _synthetic(name, tmp_path, *extra):
    common = ["--synthetic", "--synthetic-size", 32, "--epochs", 1, "--batch-size", 8]
    if name == "dcgan":
        return [*common, "--dataset", "cifar10", "--image-size", 8, "--ngf", 4, "--ndf", 4, "--nz", 4,
                "--outf", tmp_path / "out", *extra]
    small = ["--width", 4] if name in ("cifar10", "mnist") else ["--hidden-size", 8, "--embedding-size", 4]
    return [*common, *small, "--checkpoint-file", tmp_path / "run.pt", "--metrics-file", tmp_path / "run.json",
            *extra]


@pytest.mark.parametrize("name", ["cifar10", "mnist", "char_lstm", "dcgan"])
def test_synthetic_data_trains_without_files(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data folder anywhere
    out = run_example(name, _synthetic(name, tmp_path, "--no-progress", "--data-root", tmp_path / "none"), capsys)
    assert re.search(r"ε = [0-9.]+ at δ", out)


def _bar_epsilons(name, argv, capsys):
    """The ε values shown by the progress bars of a run, in order."""
    capsys.readouterr()
    assert example_module(name).main([str(a) for a in argv]) in (0, None)
    return [float(e) for e in re.findall(r"eps=([0-9.]+)", capsys.readouterr().err)]


@pytest.mark.parametrize("name", ["cifar10", "dcgan"])
def test_progress_bar_shows_epsilon_from_the_first_step(name, tmp_path, capsys):
    epsilons = _bar_epsilons(name, _synthetic(name, tmp_path), capsys)
    assert epsilons and epsilons[0] > 0


def test_dcgan_print_freq_sets_how_often_epsilon_is_refreshed(tmp_path, capsys):
    every_step = _bar_epsilons("dcgan", _synthetic("dcgan", tmp_path, "-p", 1), capsys)
    first_only = _bar_epsilons("dcgan", _synthetic("dcgan", tmp_path, "-p", 100), capsys)
    # 32 examples, B = 8: 4 steps. -p 100: the first step's ε, then the epoch's final ε (drawn as
    # the bar closes, the figure the epoch's line prints), the same as -p 1 shows after step 4.
    assert len(set(every_step)) == 4
    assert set(first_only) == {every_step[0], every_step[-1]}


def test_offline_download_ends_in_one_clear_line(tmp_path, capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    for name in ("cifar10", "mnist"):
        with pytest.raises(SystemExit) as exit_info:
            example_module(name).main(["--download", "--data-root", str(tmp_path / name), "--epochs", "1"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: could not download") and "--synthetic" in err[0]


def test_start_epoch_lr_schedule_and_per_layer_clipping(tmp_path, capsys):
    argv = _synthetic("cifar10", tmp_path, "--no-progress", "--epochs", 3, "--start-epoch", 2,
                      "--lr-schedule", "cos", "--clip_per_layer")
    run_example("cifar10", argv, capsys)
    metrics = read_json(tmp_path / "run.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [2, 3]
    loop = __import__("common.loop", fromlist=["set_learning_rate"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    loop.set_learning_rate(optimizer, argparse.Namespace(lr=1.0, epochs=3, lr_schedule="cos"), 2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi / 2)).item()))
    privacy = __import__("common.privacy", fromlist=["clipping_bounds"])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    clipping, bounds = privacy.clipping_bounds(argparse.Namespace(clip_per_layer=True, max_grad_norm=2.0), model)
    assert clipping == "per_layer" and bounds == pytest.approx([1.0] * 4)


def test_local_rank_flag_is_the_fallback_of_the_environment(monkeypatch):
    distributed = __import__("common.distributed", fromlist=["init_distributed"])
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    setup = distributed.init_distributed("cpu", local_rank=0)
    assert (setup.local_rank, setup.world_size) == (0, 1)


def test_secure_rng_sampling_generator_is_not_rebuilt_from_its_seed():
    """--secure-rng: the Poisson loader's generator (the classic API samples with it) has its whole
    state from the OS. Oracle: a generator seeded with its initial seed (torch keeps 32 bits of
    that seed, a search) draws otherwise; two such generators draw differently."""
    example_module("cifar10")  # examples/ on the path
    privacy = __import__("common.privacy", fromlist=["_sampling_generator"])
    secure = argparse.Namespace(secure_rng=True, seed=0)
    first, second = privacy._sampling_generator(secure), privacy._sampling_generator(secure)
    rebuilt = torch.Generator().manual_seed(first.initial_seed())
    draws = torch.rand(64, generator=first)
    assert not torch.equal(draws, torch.rand(64, generator=rebuilt))
    assert not torch.equal(draws, torch.rand(64, generator=second))

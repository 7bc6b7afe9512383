"""The De et al. 2022 recipe of examples/cifar10.py: the weight-standardised Wide ResNet (its
per-sample gradients against batch-size-1 autograd), the parameter EMA (against a hand
computation), the crop+flip augmentation, and end-to-end runs on a tiny CIFAR-10 copy in the real
pickle format."""

import copy
import importlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.engine.helpers import clipped_sum_oracle, per_sample_grads_oracle
from tests.examples.example_runs import (
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    example_module,
    load_checkpoint,
    read_json,
    run_example,
)
from tests.examples.fake_data import write_cifar10
from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples

pytestmark = pytest.mark.filterwarnings(SECURE_MODE_WARNING)

SIGMA = 1.5


def _common(name: str):
    """``examples/common/<name>.py`` (the example puts ``examples/`` on the path)."""
    example_module("cifar10")
    return importlib.import_module(f"common.{name}")


def _tiny_wrn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _common("wide_resnet").wide_resnet(depth=10, width=1).double()


# ------------------------------------------------------------------ weight-standardised WRN
def test_ws_conv_standardises_each_output_channel():
    wsconv = _common("wide_resnet").WSConv2d(3, 4, 3, padding=1, eps=1e-5).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.double)
    w = wsconv.weight.detach().numpy()
    hand = np.stack([(w[o] - w[o].mean()) / np.sqrt(w[o].var() + 1e-5) for o in range(4)])
    expected = F.conv2d(x, torch.from_numpy(hand), wsconv.bias, padding=1)
    torch.testing.assert_close(wsconv(x), expected, rtol=1e-12, atol=1e-12)


def test_wrn_16_4_layout():
    wrn = _common("wide_resnet")
    model = wrn.wide_resnet()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(isinstance(m, wrn.WSConv2d) for m in convs)
    assert sum(m.kernel_size == (3, 3) for m in convs) == 13  # stem + 3 stages × 2 blocks × 2
    assert [m.out_channels for m in convs if m.kernel_size == (1, 1)] == [64, 128, 256]
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_groups == 16 for m in norms)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("force_functorch", [False, True], ids=["hooks", "functorch"])
def test_wrn_per_sample_gradients_match_the_oracle(force_functorch):
    model = _tiny_wrn()
    x = torch.randn(3, 3, 8, 8, dtype=torch.double)
    expected = oracle_grad_samples(model, (x,))
    actual = gsm_grad_samples(model, (x,), force_functorch=force_functorch, loss_reduction="sum")
    assert_grad_samples_close(actual, expected)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_private_step_is_the_hand_clipped_mean(mode):
    """σ = 0, C below the gradients' norms: one SGD step moves by −lr · Σ_i min(1, C/‖g_i‖) g_i / B."""
    from opacus_dp import PrivacyEngine

    batch, bound, lr = 4, 0.05, 0.5
    net = _tiny_wrn(seed=3)
    x = torch.randn(batch, 3, 8, 8, dtype=torch.double)
    y = torch.tensor([0, 3, 7, 9])
    grads = per_sample_grads_oracle(copy.deepcopy(net), x, y)
    norms = torch.sqrt(sum(g.reshape(batch, -1).pow(2).sum(1) for g in grads))
    assert bool((norms > 2 * bound).all())  # clipping is active for every example
    summed = clipped_sum_oracle(grads, bound, per_layer=False)
    expected = [p.detach() - lr * s / batch for p, s in zip(net.parameters(), summed)]

    data = DataLoader(TensorDataset(torch.cat([x, x]), torch.cat([y, y])), batch_size=batch)  # q·N = 4
    model, optimizer, _ = PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr), data_loader=data,
        noise_multiplier=0.0, max_grad_norm=bound, grad_sample_mode=mode)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------- EMA
def test_ema_decay_warm_up():
    ema_decay = _common("ema").ema_decay
    assert ema_decay(0.999999, 0) == pytest.approx(0.1)
    assert ema_decay(0.999999, 90) == pytest.approx(0.91)
    assert ema_decay(0.999, 10**7) == 0.999


def test_ema_matches_a_hand_computation():
    ema = _common("ema")
    net = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    model = ema.EMAModel(net, decay=0.2)
    for value in (2.0, 4.0, 8.0):
        with torch.no_grad():
            net.weight.fill_(value)
        model.update()
    # β_0 = min(.2, 1/10) = .1:  .1·1 + .9·2 = 1.9
    # β_1 = min(.2, 2/11) = 2/11: (2/11)·1.9 + (9/11)·4 = 39.8/11
    # β_2 = min(.2, 3/12) = .2:  .2·39.8/11 + .8·8 = 7.96/11 + 6.4
    assert float(model.averaged_parameters()["weight"]) == pytest.approx(7.96 / 11 + 6.4, rel=1e-6)
    assert int(model.updates) == 3


def test_ema_model_evaluates_with_the_averages_and_restores():
    ema = _common("ema")
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model = ema.EMAModel(net, decay=0.5)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    model.update()
    x = torch.randn(5, 3)
    trained = [p.detach().clone() for p in net.parameters()]
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for p, average in zip(twin.parameters(), model.averaged_parameters().values()):
            p.copy_(average)
    assert torch.equal(model.train()(x), net(x))
    assert torch.equal(model.eval()(x), twin(x))
    assert not torch.allclose(twin(x), net(x))
    with model.averaged() as plain:
        assert torch.equal(plain(x), twin(x))
    assert all(torch.equal(p, t) for p, t in zip(net.parameters(), trained))


def test_ema_follows_each_released_private_step_once():
    """Through BatchMemoryManager (several pieces per step): one update per accounted step, equal
    to the hand recursion over the parameters released after each step; other optimizers ignored."""
    from opacus_dp import PrivacyEngine
    from opacus_dp.data import BatchMemoryManager

    ema, decay = _common("ema"), 0.3
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    data = TensorDataset(torch.randn(32, 4, dtype=torch.double), torch.randint(0, 3, (32,)))
    with ema.updated_after_steps() as track:
        model = track(ema.EMAModel(net, decay))
        hand = [p.detach().clone() for p in net.parameters()]
        engine = PrivacyEngine()
        wrapped, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
            data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.5, max_grad_norm=1.0)
        other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as pieces:
            for x, y in pieces:
                steps = len(engine.accountant)
                optimizer.zero_grad()
                F.cross_entropy(wrapped(x), y).backward()
                optimizer.step()
                other.step()
                if len(engine.accountant) > steps:
                    t = int(model.updates) - 1  # updates before this step's
                    beta = min(decay, (1 + t) / (10 + t))
                    hand = [beta * h + (1 - beta) * p.detach() for h, p in zip(hand, net.parameters())]
    assert int(model.updates) == len(engine.accountant) == 4
    for h, average in zip(hand, model.averaged_parameters().values()):
        torch.testing.assert_close(average, h, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------ augmentation
def test_crop_flip_is_a_reflect_padded_crop_maybe_flipped():
    transform = example_module("cifar10").crop_flip(side=8, padding=2)
    torch.manual_seed(0)
    image = torch.randn(3, 8, 8)
    padded = F.pad(image[None], (2, 2, 2, 2), mode="reflect")[0]
    candidates = [c for i in range(5) for j in range(5)
                  for c in (padded[:, i:i + 8, j:j + 8], padded[:, i:i + 8, j:j + 8].flip(-1))]
    seen = set()
    for _ in range(30):
        out = transform(image)
        matches = [k for k, c in enumerate(candidates) if torch.equal(out, c)]
        assert matches, "not a crop of the reflect-padded image"
        seen.add(matches[0])
    assert len(seen) > 5  # independent draws


# ---------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv, message", [
    (["--augmult", "0"], "--augmult must be at least 1"),
    (["--ema-decay", "1"], "--ema-decay must lie in [0, 1)"),
    (["--arch", "wrn16_4", "--depth", "14"], "WRN depth 6n+4"),
    (["--arch", "resnet", "--depth", "16"], "ResNet depth 6n+2"),
    (["--augmult", "4", "--api", "classic"], "needs the modern API"),
])
def test_recipe_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example_module("cifar10").parse_args(["--synthetic", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_arch_and_architecture_are_one_flag():
    cifar10 = example_module("cifar10")
    assert cifar10.parse_args(["--arch", "resnet"]).architecture == "resnet"
    assert cifar10.parse_args(["--architecture", "wrn16_4"]).architecture == "wrn16_4"


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return write_cifar10(str(tmp_path_factory.mktemp("cifar")), per_batch=8, test_size=16)


def _run(data_root, out, name, *extra, capsys):
    """One epoch of WRN-10-1 with q = 8/40 (5 steps); the printed output."""
    argv = ["--data-root", data_root, "--epochs", 1, "--arch", "wrn16_4", "--depth", 10, "--width", 1,
            "--batch-size", 8, "--sigma", SIGMA, "--optim", "SGD", "--lr", 0.5,
            "--checkpoint-file", out / f"{name}.pt", "--metrics-file", out / f"{name}.json",
            "--no-progress", *extra]
    return run_example("cifar10", argv, capsys)


@pytest.mark.slow
def test_wrn_with_ema_trains_the_same_and_evaluates_the_average(data_root, tmp_path, capsys):
    out = _run(data_root, tmp_path, "ema", "--ema-decay", 0.9, capsys=capsys)
    _run(data_root, tmp_path, "plain", capsys=capsys)
    metrics = read_json(tmp_path / "ema.json")
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=0.2, steps=5)
    assert_epsilon_consistent(out, metrics["privacy"])
    saved = load_checkpoint(tmp_path / "ema.pt")["module_state_dict"]
    plain = load_checkpoint(tmp_path / "plain.pt")["module_state_dict"]
    assert int(saved["updates"]) == 5  # one EMA update per private step
    for key, value in plain.items():  # the EMA only watches: the trained weights are the same
        assert torch.equal(saved[f"net.{key}"], value), key
    assert any(not torch.equal(saved[f"averages.average_{i}"], plain[key]) for i, key in enumerate(plain))

    wrn, ema = _common("wide_resnet"), _common("ema")
    model = ema.EMAModel(wrn.wide_resnet(depth=10, width=1), decay=0.9)
    model.load_state_dict(saved)
    vision_data, loop = _common("vision_data"), _common("loop")
    test = DataLoader(vision_data.cifar10(data_root, download=False, train=False), batch_size=64)
    accuracy = metrics["epochs"][-1]["test_accuracy"]
    assert loop.evaluate(model, test, torch.device("cpu"))["accuracy"] == pytest.approx(accuracy)
    with model.averaged() as net:
        assert loop.evaluate(net, test, torch.device("cpu"))["accuracy"] == pytest.approx(accuracy)


@pytest.mark.slow
def test_augmult_is_accounted_as_one_example_per_image(data_root, tmp_path, capsys, monkeypatch):
    from opacus_dp import PrivacyEngine

    passed = []
    make_private = PrivacyEngine.make_private

    def spy(self, **kwargs):
        passed.append(kwargs.get("augmentation_multiplicity"))
        return make_private(self, **kwargs)

    monkeypatch.setattr(PrivacyEngine, "make_private", spy)
    out = _run(data_root, tmp_path, "k4", "--augmult", 4, "--n-accumulation-steps", 2, "--batch-size", 4,
               "--ema-decay", 0.9, capsys=capsys)
    _run(data_root, tmp_path, "k1", capsys=capsys)
    assert passed == [4, None]  # only K > 1 is passed on
    privacy = read_json(tmp_path / "k4.json")["privacy"]
    assert_history(privacy, sigma=SIGMA, sample_rate=0.2, steps=5)  # q of examples, not rows
    assert_epsilon_consistent(out, privacy)
    assert read_json(tmp_path / "k4.json")["epsilon"] == read_json(tmp_path / "k1.json")["epsilon"]
    assert int(load_checkpoint(tmp_path / "k4.pt")["module_state_dict"]["updates"]) == 5

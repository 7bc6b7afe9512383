"""Modern (Opacus 1.x) API: make_private, make_private_with_epsilon, get_epsilon, checkpoints."""

import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import create_accountant
from opacus_dp.data import SamplingWarning
from opacus_dp.data.step_per_batch import SkippedBatchError
from opacus_dp.utils.batch_memory_manager import BatchMemoryManager
from tests.engine.helpers import small_data, small_loader, small_model, train_plain

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode is off")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def run_readme_loop(privacy_engine, model, optimizer, data_loader, epochs):
    """The training loop of the Opacus 1.x README/tutorials, unchanged."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    steps = 0
    for _ in range(epochs):
        for x, y in data_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            steps += 1
    return steps


def test_readme_make_private_loop_runs_and_reports_accountant_epsilon():
    torch.manual_seed(0)
    model = Net().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data_loader = small_loader(n=20, batch_size=2)  # q = 0.1: empty batches are frequent
    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, data_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=data_loader,
        noise_multiplier=1.1,
        max_grad_norm=1.0,
    )
    steps = run_readme_loop(privacy_engine, model, optimizer, data_loader, epochs=3)
    assert steps == 30
    oracle = create_accountant("rdp")
    for _ in range(steps):
        oracle.step(noise_multiplier=1.1, sample_rate=0.1)
    assert privacy_engine.get_epsilon(1e-5) == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-12)
    assert [tuple(h) for h in privacy_engine.accountant.history] == [(1.1, 0.1, 30)]


def test_empty_poisson_batches_are_accounted_steps():
    torch.manual_seed(3)
    engine = PrivacyEngine(accountant="rdp")
    model = small_model()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=small_loader(n=8, batch_size=1), noise_multiplier=1.0, max_grad_norm=1.0)
    sizes = []
    for _ in range(4):
        for x, y in loader:
            sizes.append(len(x))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert 0 in sizes  # P(no empty batch in 32 draws) = (1 - (7/8)^8)^32 < 1e-5
    assert len(engine.accountant) == len(sizes)


def test_sigma0_unbounded_clip_make_private_equals_plain_training():
    x, y = small_data(12)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]
    expected = train_plain(small_model(), batches, lambda ps: torch.optim.SGD(ps, lr=0.2))
    model = small_model()
    engine = PrivacyEngine(accountant="rdp")
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    with pytest.warns(UserWarning):  # fixed-size batches are not Poisson sampling
        gsm, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=math.inf, poisson_sampling=False)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(xb), yb).backward()
        opt.step()
    for a, b in zip(model.parameters(), expected):
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_batch_memory_manager_equals_one_logical_step(mode):
    """Physical batches of ≤ 2 + skipped steps give the same update as the whole logical batch."""
    def make(max_physical):
        torch.manual_seed(11)
        model = small_model()
        engine = PrivacyEngine(accountant="rdp")
        gsm, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
            data_loader=small_loader(n=12, batch_size=6), noise_multiplier=0.0, max_grad_norm=0.3,
            grad_sample_mode=mode)
        sizes = []
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical,
                                optimizer=opt) as physical:
            for xb, yb in physical:
                sizes.append(len(xb))
                opt.zero_grad()
                nn.functional.cross_entropy(gsm(xb), yb).backward()
                opt.step()
        return [p.detach() for p in model.parameters()], len(engine.accountant), sizes

    whole, steps_whole, sizes_whole = make(1000)
    split, steps_split, sizes_split = make(2)
    assert steps_whole == steps_split == 2
    assert max(sizes_split) <= 2 and len(sizes_split) > len(sizes_whole)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _poisson_run(mode):
    torch.manual_seed(5)
    model = small_model()
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
        data_loader=small_loader(n=24, batch_size=6), noise_multiplier=0.0, max_grad_norm=0.3,
        grad_sample_mode=mode)
    return model, engine, gsm, opt, loader


MERGES = {  # loops that merge two Poisson batches into one step, or may
    "virtual_step_across_batches": lambda opt, gsm, batches: _merge(opt, gsm, batches, opt.virtual_step),
    "skip_signal_across_batches": lambda opt, gsm, batches: _merge(
        opt, gsm, batches, lambda: (opt.signal_skip_step(True), opt.step())),
    "batches_fetched_ahead": lambda opt, gsm, batches: _merge(opt, gsm, list(batches), opt.virtual_step),
}


def _merge(opt, gsm, batches, accumulate):
    batches = iter(batches)
    for call in (accumulate, opt.step):
        xb, yb = next(batches)
        nn.functional.cross_entropy(gsm(xb), yb).backward()
        call()


@pytest.mark.parametrize("loop", sorted(MERGES))
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_merging_poisson_batches_into_one_step_is_refused(mode, loop):
    """A sample drawn in two merged batches would count twice where one batch of rate q is
    recorded; the optimizer cannot tell pieces of one batch from two (batches fetched ahead look
    like pieces), so with Poisson batches only BatchMemoryManager may split a step. Batches
    fetched ahead are refused by the loader itself (a batch handed out before its predecessor's
    step, ``SkippedBatchError``)."""
    model, engine, gsm, opt, loader = _poisson_run(mode)
    before = [p.detach().clone() for p in model.parameters()]
    refusal = (SkippedBatchError, "no optimizer.step") if loop == "batches_fetched_ahead" else (ValueError,
                                                                                                "BatchMemoryManager")
    with pytest.raises(refusal[0], match=refusal[1]):
        MERGES[loop](opt, gsm, loader)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert len(engine.accountant) == 0


def test_make_private_with_epsilon_meets_target():
    model = small_model()
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=small_loader(n=24, batch_size=6), target_epsilon=3.0, target_delta=1e-5,
        epochs=5, max_grad_norm=1.0)
    oracle = create_accountant("rdp")
    for _ in range(5 * len(loader)):
        oracle.step(noise_multiplier=opt.noise_multiplier, sample_rate=0.25)
    eps = oracle.get_epsilon(1e-5)
    assert 3.0 * 0.97 <= eps <= 3.0


def _checkpoint_run(tmp_path, interrupt: bool):
    torch.manual_seed(7)
    model = small_model()
    engine = PrivacyEngine(accountant="prv")
    gsm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        data_loader=small_loader(n=16, batch_size=4), noise_multiplier=0.8, max_grad_norm=0.5)
    for epoch in range(2):
        if interrupt and epoch == 1:
            path = tmp_path / "ckpt.pt"
            engine.save_checkpoint(path=path, module=gsm, optimizer=opt)
            torch.manual_seed(999)  # a different process: other init, other global RNG
            model = small_model(seed=123)
            engine = PrivacyEngine(accountant="prv")
            gsm, opt, loader = engine.make_private(
                module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                data_loader=small_loader(n=16, batch_size=4), noise_multiplier=0.8, max_grad_norm=0.5)
            engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(gsm(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], engine.get_epsilon(1e-5)


def test_checkpoint_resume_gives_identical_parameters_and_epsilon(tmp_path):
    params_a, eps_a = _checkpoint_run(tmp_path, interrupt=False)
    params_b, eps_b = _checkpoint_run(tmp_path, interrupt=True)
    assert eps_a == eps_b
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)


def test_checkpoint_keys_have_no_wrapper_prefix(tmp_path):
    model = small_model()
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=small_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=gsm, optimizer=opt)
    saved = torch.load(tmp_path / "c.pt", weights_only=False)
    assert set(saved["module_state_dict"]) == set(small_model().state_dict())
    plain = small_model(seed=5)
    plain.load_state_dict(saved["module_state_dict"])
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _engine_args(model, **overrides):
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=small_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(grad_sample_mode="magic"), "grad_sample_mode"),
        (dict(clipping="adaptive"), "clipping"),
        (dict(loss_reduction="avg"), "loss_reduction"),
        (dict(noise_multiplier=-0.5), "noise_multiplier"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm=[1.0, 2.0], clipping="per_layer"), "max_grad_norm"),
        (dict(noise_generator=torch.Generator()), "noise_generator"),
    ],
)
def test_make_private_bad_arguments(overrides, match):
    secure = "noise_generator" in overrides
    engine = PrivacyEngine(accountant="rdp", secure_mode=secure)
    model = small_model()
    with pytest.raises(ValueError, match=match):
        engine.make_private(**_engine_args(model, **overrides))
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_optimizer_with_foreign_parameters_is_refused():
    model, other = small_model(), small_model(seed=1)
    engine = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match="not a parameter of the module"):
        engine.make_private(**_engine_args(model, optimizer=torch.optim.SGD(other.parameters(), lr=1)))


def test_batchnorm_model_is_refused_with_validator_message():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    engine = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match="BatchNorm"):
        engine.make_private(**_engine_args(model))


def test_modern_engine_rejects_positional_non_module():
    with pytest.raises(TypeError, match="keyword"):
        PrivacyEngine("rdp")


def test_no_warning_about_sampling_for_poisson_loader():
    model = small_model()
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.make_private(**_engine_args(model))


@pytest.mark.parametrize("poisson_sampling", [True, False])
@pytest.mark.parametrize("n, batch", [(98, 2), (196, 4), (206, 2), (100, 3), (60, 7)])
def test_expected_batch_size_is_the_floor_of_n_over_the_number_of_batches(n, batch, poisson_sampling):
    """q = 1/L with L = ⌈N/B⌉ batches; E = ⌊q·N⌋ = N // L in exact integers (the floating
    product 98·(1/49) = 1.9999999999999998 had given 1, dividing every update by 1 for 2)."""
    model = small_model()
    loader = DataLoader(TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,))), batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson_sampling)
    assert optimizer.expected_batch_size == n // math.ceil(n / batch)


@pytest.mark.parametrize("accountant, epsilon_kwargs", [("rdp", {"alphas": [2, 4, 8, 16, 32]}),
                                                         ("prv", {"eps_error": 0.05})])
def test_make_private_with_epsilon_forwards_accountant_arguments(accountant, epsilon_kwargs):
    """As in Opacus, extra keywords reach the accountant during the calibration: ε after the
    planned epochs, computed with the same arguments, is within the target."""
    model = small_model()
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=small_loader(), target_epsilon=2.0, target_delta=1e-5, epochs=3,
            max_grad_norm=1.0, **epsilon_kwargs)
    check = create_accountant(accountant)
    check.history = [(optimizer.noise_multiplier, loader.sample_rate, 3 * len(loader))]
    assert 1.9 <= check.get_epsilon(1e-5, **epsilon_kwargs) <= 2.0


def test_opacus_wrap_model_and_rand_on_empty_flags():
    """wrap_model=False: the original module trains privately (the hooks sit on its layers) —
    its update equals the wrapped run's; rand_on_empty=True warns that it has no effect."""
    updates = []
    for wrap in (True, False):
        model = small_model()
        before = [p.detach().clone() for p in model.parameters()]
        x, y = small_data()
        with pytest.warns(SamplingWarning, match="fixed-size batches"):
            gsm, optimizer, _ = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)), noise_multiplier=0.0,
                max_grad_norm=0.1, poisson_sampling=False, wrap_model=wrap)
        nn.functional.cross_entropy((gsm if wrap else model)(x), y).backward()
        optimizer.step()
        updates.append([b - p.detach() for b, p in zip(before, model.parameters())])
    for a, b in zip(*updates):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    model = small_model()
    with pytest.warns(UserWarning, match="rand_on_empty=True has no effect"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                     data_loader=small_loader(), noise_multiplier=1.0, max_grad_norm=1.0,
                                     rand_on_empty=True)
    with pytest.raises(TypeError, match="wrap_model must be a bool"):
        PrivacyEngine().make_private(module=small_model(), optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                     data_loader=small_loader(), noise_multiplier=1.0, max_grad_norm=1.0,
                                     wrap_model="no")


def test_checkpoint_module_state_loads_into_the_wrapped_model_too(tmp_path):
    """Opacus scripts load ``torch.load(path)["module_state_dict"]`` into the model make_private
    returned; the saved keys have no wrapper prefix, and either form loads."""
    model = small_model()
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=small_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=gsm, optimizer=opt)
    saved = torch.load(tmp_path / "c.pt", weights_only=False)["module_state_dict"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    gsm.load_state_dict(saved)
    assert all(torch.equal(p, saved[name]) for name, p in model.named_parameters())
    gsm.load_state_dict({f"_module.{k}": torch.ones_like(v) for k, v in saved.items()})
    assert all(bool((p == 1).all()) for p in model.parameters())
    with pytest.raises(RuntimeError, match="Missing key"):
        gsm.load_state_dict({k: v for k, v in list(saved.items())[1:]})

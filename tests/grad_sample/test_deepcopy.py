"""``copy.deepcopy`` of a private model (an EMA copy): the copy is a plain model.

``copy.deepcopy`` of the wrapper that ``make_private`` returns (every mode), and of the user's
own model after ``make_private`` or the classic ``attach``, give a plain copy of the user's
model: none of the wrapper's hooks or attributes, ordinary ``p.grad`` from autograd, the user's
own hooks kept, ``state_dict`` keys of the user's model. The private model is unaffected: its
next step equals the step of a run that made no copy. Oracles: a deep copy taken before the
model was made private (hooks, attributes, keys), per-sample autograd (the private step), plain
autograd on a freshly built model (the copy's gradients), and the EMA formula by hand.
"""

import copy
import gc
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import opacus_dp
from opacus_dp.grad_sample import GradSampleModule
from tests.distributed.spawn import run_on_ranks
from tests.precision.helpers import clipped_sum, per_sample_grads, squared_error

pytestmark = [pytest.mark.filterwarnings("ignore:secure_mode"), pytest.mark.filterwarnings("ignore::UserWarning")]

MODES = ("hooks", "functorch", "ghost", "bk")
LR, C, B = 0.5, 0.5, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))
    model[0].register_forward_hook(_user_hook)  # the user's own hook: a copy keeps it
    return model


def _user_hook(module, args, output):
    return None


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 8, generator=g), torch.randn(B, 4, generator=g)


def _private(model, mode: str, distributed: bool = False):
    """``(private model, optimizer, one_step(x, y))``: ``make_private`` with σ = 0, ``C`` active,
    a sum loss, fixed batches of ``B``."""
    x, y = _batch(0)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=False) if distributed else None
    criterion = nn.MSELoss(reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opacus_dp.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(data, batch_size=B, sampler=sampler), noise_multiplier=0.0,
            max_grad_norm=C, grad_sample_mode=mode, poisson_sampling=False, loss_reduction="sum",
            **({"criterion": criterion} if mode == "ghost" else {}),
            **({"step_timeout": 10} if distributed else {}))  # below the group's 30 s
    private, optimizer = out[0], out[1]
    loss_of = out[2] if len(out) == 4 else squared_error

    def one_step(x, y, before_step=lambda: None):
        optimizer.zero_grad()
        loss_of(private(x), y).backward()
        before_step()
        optimizer.step()

    return private, optimizer, one_step


def _classic(model):
    engine = opacus_dp.PrivacyEngine(model, batch_size=B, sample_size=10 * B, noise_multiplier=0.0,
                                     max_grad_norm=C, loss_reduction="sum")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine.attach(optimizer)

    def one_step(x, y):
        optimizer.zero_grad()
        squared_error(model(x), y).backward()
        optimizer.step()

    return model, optimizer, one_step


def _hooks_of(model: nn.Module):
    """``{path: {hook table: keys}}`` of every submodule (every ``*hooks*`` dict torch keeps)."""
    return {path: {name: list(table) for name, table in vars(sub).items()
                   if "hooks" in name and isinstance(table, dict)}
            for path, sub in model.named_modules()}


def _attributes_of(model: nn.Module):
    """Instance attribute names of every submodule and parameter."""
    return ({path: sorted(vars(sub)) for path, sub in model.named_modules()},
            {name: sorted(vars(p)) for name, p in model.named_parameters()})


def _check_plain_copy(ema: nn.Module, reference: nn.Module, source: nn.Module) -> None:
    """``ema`` is a plain copy of ``source``'s weights, shaped as ``reference`` (a deep copy of
    the same model taken before it was made private)."""
    assert type(ema) is type(reference) and not isinstance(ema, GradSampleModule)
    assert _hooks_of(ema) == _hooks_of(reference)  # the user's hooks (same ids), none of ours
    assert _attributes_of(ema) == _attributes_of(reference)
    assert list(ema.state_dict()) == list(reference.state_dict())
    for e, p in zip(ema.parameters(), source.parameters()):
        assert torch.equal(e, p) and e.data_ptr() != p.data_ptr() and e.grad is None
        assert not hasattr(e, "grad_sample") and not hasattr(e, "summed_grad")


def _check_trains_normally(ema: nn.Module) -> None:
    """Ordinary autograd gradients (equal to those of a fresh model with the same weights), no
    per-sample state, and an ordinary optimizer step."""
    fresh = _model()
    fresh.load_state_dict(ema.state_dict())
    x, y = _batch(7)
    squared_error(ema(x), y).backward()
    want = torch.autograd.grad(squared_error(fresh(x), y), list(fresh.parameters()))
    for e, w in zip(ema.parameters(), want):
        assert e.grad is not None and torch.allclose(e.grad, w, rtol=1e-6, atol=1e-7)
        assert not hasattr(e, "grad_sample")
    before = [e.detach().clone() for e in ema.parameters()]
    torch.optim.SGD(ema.parameters(), lr=0.1).step()
    for e, b in zip(ema.parameters(), before):
        assert torch.allclose(e, b - 0.1 * e.grad)


def _expected_step(weights, x, y):
    """Parameters after one private step from ``weights``: ``w − lr · Σ_i clip_C(g_i)`` (σ = 0,
    sum loss), per-sample gradients by autograd."""
    fresh = _model()
    fresh.load_state_dict(weights)
    update = clipped_sum(per_sample_grads(fresh, x, y), "flat", C)
    return [p.detach().double() - LR * u for p, u in zip(fresh.parameters(), update)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["wrapper", "model"])
def test_a_deep_copy_is_a_plain_model_that_trains_normally(mode, what):
    model = _model()
    reference = copy.deepcopy(model)  # before make_private: what a plain copy looks like
    private, _, one_step = _private(model, mode)
    one_step(*_batch(1))
    ema = copy.deepcopy(private if what == "wrapper" else model)
    _check_plain_copy(ema, reference, model)
    assert len(ema[0]._forward_hooks) == 1  # the user's hook, kept
    _check_trains_normally(ema)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["wrapper", "model"])
@pytest.mark.parametrize("when", ["between steps", "before the step"])
def test_the_private_model_is_unaffected_by_the_copy(mode, what, when):
    """Its next step equals the step of a run without the copy, and the per-sample oracle (also
    for a copy made while the per-sample state of a backward pass waits for the step)."""
    runs = []
    for make_copy in (True, False):
        model = _model()
        private, _, one_step = _private(model, mode)
        one_step(*_batch(1))

        def copy_and_train():
            ema = copy.deepcopy(private if what == "wrapper" else model)
            squared_error(ema(_batch(3)[0]), _batch(3)[1]).backward()  # the copy trains meanwhile
            torch.optim.SGD(ema.parameters(), lr=0.1).step()

        if make_copy and when == "between steps":
            copy_and_train()
        weights = copy.deepcopy(model.state_dict())
        one_step(*_batch(2), before_step=copy_and_train if make_copy and when != "between steps" else lambda: None)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b, want in zip(runs[0], runs[1], _expected_step(weights, *_batch(2))):
        assert torch.equal(a, b)
        assert torch.allclose(a.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_ema_update_and_state_dicts_between_the_copy_and_the_private_model(mode):
    decay = 0.9
    model = _model()
    private, _, one_step = _private(model, mode)
    ema = copy.deepcopy(private)
    start = [e.detach().clone() for e in ema.parameters()]
    one_step(*_batch(1))
    with torch.no_grad():
        for e, p in zip(ema.parameters(), private.parameters()):
            e.lerp_(p, 1 - decay)
    for e, s, p in zip(ema.parameters(), start, model.parameters()):
        assert torch.allclose(e, decay * s + (1 - decay) * p, rtol=1e-6, atol=1e-7)
    ema.load_state_dict(model.state_dict())  # the user's model's keys: no "_module." prefix
    private.load_state_dict(ema.state_dict())  # and back into the private model
    weights = copy.deepcopy(model.state_dict())
    one_step(*_batch(2))
    for p, want in zip(model.parameters(), _expected_step(weights, *_batch(2))):
        assert torch.allclose(p.double(), want, rtol=1e-5, atol=1e-6)


def test_classic_attach_copy_of_the_model():
    runs = []
    for make_copy in (True, False):
        model = _model()
        reference = copy.deepcopy(model)
        _, _, one_step = _classic(model)
        one_step(*_batch(1))
        if make_copy:
            ema = copy.deepcopy(model)
            _check_plain_copy(ema, reference, model)
            _check_trains_normally(ema)
        weights = copy.deepcopy(model.state_dict())
        one_step(*_batch(2))
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b, want in zip(runs[0], runs[1], _expected_step(weights, *_batch(2))):
        assert torch.equal(a, b)
        assert torch.allclose(a.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_copies_of_submodules_and_of_copies_and_after_close(mode):
    model = _model()
    reference = copy.deepcopy(model)
    private, _, one_step = _private(model, mode)
    layer = copy.deepcopy(model[2])
    assert _hooks_of(layer) == _hooks_of(copy.deepcopy(reference[2]))
    assert sorted(vars(layer)) == sorted(vars(reference[2]))
    twice = copy.deepcopy(copy.deepcopy(private))
    _check_plain_copy(twice, reference, model)
    private.close()
    after = copy.deepcopy(model)
    _check_plain_copy(after, reference, model)
    assert _attributes_of(model)[0] == _attributes_of(reference)[0]  # close() removed what it added
    dropped = _model()
    GradSampleModule(dropped)  # dropped without close(): its collection removes what it added
    gc.collect()
    assert _attributes_of(dropped)[0] == _attributes_of(reference)[0]


def test_a_frozen_batch_norm_of_the_copy_may_use_batch_statistics():
    """The private model refuses a frozen BatchNorm in training mode; its copy is a plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 4))
    model[1].requires_grad_(False)
    model[1].eval()
    private, _, one_step = _private(model, "hooks")
    one_step(*_batch(1))
    ema = copy.deepcopy(private)
    ema.train()
    out = ema(_batch(2)[0])  # batch statistics: allowed in a plain model
    want = nn.functional.batch_norm(ema[0](_batch(2)[0]), None, None, ema[1].weight, ema[1].bias,
                                    training=True, eps=ema[1].eps)
    assert torch.allclose(out, ema[2](want), rtol=1e-5, atol=1e-6)
    model.train()
    with pytest.raises(Exception, match="BatchNorm"):
        private(_batch(2)[0])


def test_pickling_the_wrapper_names_the_fix():
    model = _model()
    private, _, _ = _private(model, "hooks")
    with pytest.raises(TypeError, match="deepcopy"):
        pickle.dumps(private)
    restored = pickle.loads(pickle.dumps(copy.deepcopy(private)))  # a plain copy pickles
    assert list(restored.state_dict()) == list(model.state_dict())


def dpddp_copy_job(rank, world_size):
    """On each rank (different data): a copy of a private DPDDP model is a DPDDP over the same
    process group around a plain model; the next private step equals a run without the copy."""
    import torch.distributed as dist
    from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    group = dist.new_group(list(range(world_size)))
    runs, report = [], {}
    for make_copy in (True, False):
        model = _model()
        reference = copy.deepcopy(model)
        private, _, one_step = _private(DPDDP(model, process_group=group), "hooks", distributed=True)
        one_step(*_batch(1 + 10 * rank))
        if make_copy:
            ema = copy.deepcopy(private)
            report["type"] = type(ema).__name__
            report["same_group"] = ema.process_group is group
            report["plain"] = (_hooks_of(ema.module) == _hooks_of(reference)
                               and _attributes_of(ema.module) == _attributes_of(reference))
            _check_trains_normally(ema.module)
        one_step(*_batch(2 + 10 * rank))
        runs.append([p.detach().clone() for p in model.parameters()])
    report["unaffected"] = all(torch.equal(a, b) for a, b in zip(*runs))
    return report


def test_a_copy_of_a_private_dpddp_model_shares_the_process_group():
    for report in run_on_ranks(dpddp_copy_job, 2, timeout=60):
        assert report == {"type": "DifferentiallyPrivateDistributedDataParallel", "same_group": True,
                          "plain": True, "unaffected": True}


def test_torch_averaged_model_of_a_private_model():
    """``torch.optim.swa_utils.AveragedModel`` deep-copies the model it averages: an EMA by hand."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    decay = 0.8
    model = _model()
    private, _, one_step = _private(model, "bk")
    averaged = AveragedModel(private, multi_avg_fn=get_ema_multi_avg_fn(decay))
    assert type(averaged.module) is nn.Sequential
    expected = [p.detach().clone() for p in model.parameters()]
    for seed in (1, 2):
        one_step(*_batch(seed))
        averaged.update_parameters(private)
        if seed > 1:  # the first update copies the parameters
            expected = [decay * e + (1 - decay) * p for e, p in zip(expected, model.parameters())]
        else:
            expected = [p.detach().clone() for p in model.parameters()]
    for a, e in zip(averaged.module.parameters(), expected):
        assert torch.allclose(a, e, rtol=1e-6, atol=1e-7)
    x = _batch(3)[0]
    assert torch.allclose(averaged(x), averaged.module(x))


def test_a_copy_leaves_out_a_taken_over_data_parallel_replicate():
    """``nn.DataParallel`` inside the model: the instance ``replicate`` the wrapper adds is not copied."""
    torch.manual_seed(0)
    model = nn.DataParallel(nn.Sequential(nn.Linear(8, 4)))
    reference = copy.deepcopy(model)
    private = GradSampleModule(model)
    private(_batch(1)[0]).sum().backward()
    assert "replicate" in vars(model)  # taken over at its call
    ema = copy.deepcopy(private)
    assert type(ema) is nn.DataParallel
    assert _hooks_of(ema) == _hooks_of(reference) and _attributes_of(ema) == _attributes_of(reference)
    ema(_batch(2)[0]).sum().backward()
    assert all(p.grad is not None and not hasattr(p, "grad_sample") for p in ema.parameters())
    private.close()

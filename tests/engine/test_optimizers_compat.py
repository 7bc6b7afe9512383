"""``opacus_dp.optimizers`` (Opacus 1.x ``opacus.optimizers``): the same updates as Opacus's
classes from the same per-sample gradients (σ = 0), and clear refusals for the combinations
that ``make_private`` sets up."""

import pytest
import torch
import torch.nn as nn


def _step(module, make_optimizer, grad_samples, bound):
    model = nn.Linear(3, 2).double()
    with torch.no_grad():
        for p, w in zip(model.parameters(), (torch.arange(6.0).reshape(2, 3) / 7, torch.tensor([0.1, -0.2]))):
            p.copy_(w)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(module)(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                       max_grad_norm=bound, expected_batch_size=5)
    for p, g in zip(model.parameters(), grad_samples):
        p.grad_sample = g.clone()
        p.grad = g.sum(0)
    optimizer.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


@pytest.mark.parametrize("name, bound", [("DPOptimizer", 0.4), ("DPPerLayerOptimizer", [0.3, 0.2])])
def test_compat_optimizers_update_like_opacus(name, bound):
    import opacus.optimizers

    import opacus_dp.optimizers

    g = torch.Generator().manual_seed(0)
    grad_samples = [torch.randn(5, 2, 3, generator=g, dtype=torch.float64),
                    torch.randn(5, 2, generator=g, dtype=torch.float64)]
    ours = _step(opacus_dp.optimizers, lambda m: getattr(m, name), grad_samples, bound)
    theirs = _step(opacus.optimizers, lambda m: getattr(m, name), grad_samples, bound)
    for a, b in zip(ours, theirs):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_per_layer_instances_are_recognised_whoever_built_them():
    from opacus_dp.optimizers import DPOptimizer, DPPerLayerOptimizer

    model = nn.Linear(3, 2)
    direct = DPPerLayerOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                 max_grad_norm=[1.0, 1.0], expected_batch_size=4)
    by_argument = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                              max_grad_norm=[1.0, 1.0], expected_batch_size=4)
    flat = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                       max_grad_norm=1.0, expected_batch_size=4)
    assert isinstance(direct, DPPerLayerOptimizer) and isinstance(direct, DPOptimizer)
    assert isinstance(by_argument, DPPerLayerOptimizer)
    assert not isinstance(flat, DPPerLayerOptimizer)


def test_get_optimizer_class():
    from opacus_dp.optimizers import DPOptimizer, DPPerLayerOptimizer, get_optimizer_class

    assert get_optimizer_class("flat", False) is DPOptimizer
    assert get_optimizer_class("per_layer", False, "functorch") is DPPerLayerOptimizer
    with pytest.raises(ValueError, match="use PrivacyEngine.make_private"):
        get_optimizer_class("adaptive", True)
    with pytest.raises(ValueError, match="use PrivacyEngine.make_private"):
        get_optimizer_class("per_layer", False, "ghost")
    with pytest.raises(ValueError, match="clipping must be"):
        get_optimizer_class("automatic", False)


def test_pre_step_sets_the_private_gradient_like_opacus_and_leaves_the_update_to_the_caller():
    """``pre_step()`` (Opacus 1.x): clip, accumulate, noise (σ = 0 here), scale into p.grad and
    run the step hooks, but not the inner optimizer's update; ``grad_samples`` lists them."""
    import opacus.optimizers

    import opacus_dp.optimizers

    g = torch.Generator().manual_seed(1)
    grad_samples = [torch.randn(5, 2, 3, generator=g, dtype=torch.float64),
                    torch.randn(5, 2, generator=g, dtype=torch.float64)]
    grads, recorded = [], []
    for module in (opacus_dp.optimizers, opacus.optimizers):
        model = nn.Linear(3, 2).double()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = module.DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                       max_grad_norm=0.4, expected_batch_size=5)
        optimizer.attach_step_hook(lambda opt: recorded.append(module.__name__))
        for p, gs in zip(model.parameters(), grad_samples):
            p.grad_sample = gs.clone()
        assert all(torch.equal(a, b) for a, b in zip(optimizer.grad_samples, grad_samples))
        assert optimizer.pre_step() is True
        assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())), "no update yet"
        grads.append([p.grad.clone() for p in model.parameters()])
    assert recorded == ["opacus_dp.optimizers", "opacus.optimizers"]
    for a, b in zip(*grads):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_expanded_weights_mode_updates_like_opacus_ew():
    """``grad_sample_mode="ew"`` (Opacus's ExpandedWeights) runs ``hooks``: the same σ = 0
    update as Opacus's own "ew" mode, with clipping active."""
    import warnings

    import opacus
    from torch.utils.data import DataLoader, TensorDataset

    import opacus_dp

    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(16, 5, generator=g) * 4, torch.randint(0, 3, (16,), generator=g))
    results = []
    for library in (opacus, opacus_dp):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gsm, optimizer, loader = library.PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=0.1,
                poisson_sampling=False, grad_sample_mode="ew")
        for x, y in loader:
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(gsm(x), y).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    torch.manual_seed(0)
    start = [p.detach() for p in nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).parameters()]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(results[1], start))
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_sub_packages_are_attributes_after_import_as_in_opacus():
    """``import opacus; opacus.validators.ModuleValidator`` works in Opacus; a fresh interpreter
    checks the same for opacus_dp (nothing imported beforehand)."""
    import subprocess
    import sys

    code = ("import opacus_dp as opacus\n"
            "print(opacus.validators.ModuleValidator.__name__, opacus.accountants.RDPAccountant.__name__,"
            " opacus.optimizers.AdaClipDPOptimizer.__name__, opacus.schedulers.StepNoise.__name__,"
            " opacus.grad_sample.utils.get_gsm_class.__name__, opacus.grad_sample.get_gsm_class.__name__,"
            " opacus.utils.module_utils.clone_module.__name__,"
            " opacus.utils.fast_gradient_clipping_utils.DPLossFastGradientClipping.__name__)\n"
            "try:\n    opacus.no_such_module\nexcept AttributeError as e:\n    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ModuleValidator", "RDPAccountant", "AdaClipDPOptimizer", "StepNoise", "get_gsm_class",
                   "get_gsm_class", "clone_module", "DPLossFastGradientClipping", "refused"]


def test_module_and_grad_sample_utils_agree_with_opacus():
    from opacus.utils import module_utils as theirs

    from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
    from opacus_dp.grad_sample.utils import get_gsm_class, register_grad_sampler, wrap_model
    from opacus_dp.utils import module_utils as ours

    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)), nn.LayerNorm(2))
    model[2].requires_grad_(False)
    model[0].bias.requires_grad_(False)
    for name in ("parametrized_modules", "trainable_modules", "trainable_parameters"):
        assert [n for n, _ in getattr(ours, name)(model)] == [n for n, _ in getattr(theirs, name)(model)], name
    for sub in model.modules():
        assert ours.has_trainable_params(sub) == theirs.has_trainable_params(sub)
        for recurse in (False, True):
            assert ours.requires_grad(sub, recurse=recurse) == theirs.requires_grad(sub, recurse=recurse)
    clone = ours.clone_module(model)
    assert clone is not model and ours.are_state_dict_equal(clone.state_dict(), model.state_dict())
    assert ours.get_submodule(model, "1.1") is model[1][1] is theirs.get_submodule(model, "1.1")
    with torch.no_grad():
        clone[0].weight.add_(1.0)
    assert not ours.are_state_dict_equal(clone.state_dict(), model.state_dict())
    assert get_gsm_class("hooks") is GradSampleModule and issubclass(get_gsm_class("bk"), BookkeepingGradSampleModule)
    ghost = wrap_model(nn.Linear(3, 2), "ghost", max_grad_norm=0.3, use_ghost_clipping=True)  # Opacus's keywords
    assert ghost.max_grad_norm == 0.3
    wrapped = wrap_model(nn.Linear(3, 2), "hooks")
    wrapped(torch.randn(5, 3)).sum().backward()
    assert wrapped._module.weight.grad_sample.shape == (5, 2, 3) and wrapped._module.weight.grad is not None
    assert callable(register_grad_sampler)


@pytest.mark.parametrize("padding", [(1, 2), "same", "valid"])
def test_tensor_utils_agree_with_opacus(padding):
    from opacus.utils import tensor_utils as theirs

    from opacus_dp.utils import tensor_utils as ours

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)
    options = dict(kernel_size=(3, 2), padding=padding, stride=(1, 1) if padding == "same" else (2, 1),
                   dilation=(2, 1))
    torch.testing.assert_close(ours.unfold2d(x, **options), theirs.unfold2d(x, **options), rtol=0, atol=0)
    v = torch.randn(2, 2, 5, 6, 4, generator=g, dtype=torch.float64)
    for kwargs in (dict(kernel_size=2), dict(kernel_size=(3, 2, 2), padding=1, stride=(1, 2, 1), dilation=(1, 1, 2))):
        torch.testing.assert_close(ours.unfold3d(v, **kwargs), theirs.unfold3d(v, **kwargs), rtol=0, atol=0)
    grads = [("a", torch.randn(4, 3, 2, generator=g)), ("b", torch.randn(4, 5, generator=g))]
    for flat in (True, False):
        for a, b in zip(ours.calc_sample_norms(grads, flat=flat), theirs.calc_sample_norms(grads, flat=flat)):
            torch.testing.assert_close(a, b)
    t = torch.randn(2, 3, 4, 5, generator=g)
    for n in (1, 2, 3):
        torch.testing.assert_close(ours.sum_over_all_but_batch_and_last_n(t, n),
                                   theirs.sum_over_all_but_batch_and_last_n(t, n))


def test_opacus_optimizer_module_paths():
    from opacus_dp.optimizers import (AdaClipDPOptimizer, DPOptimizer, DPOptimizerFastGradientClipping,
                                      DPPerLayerOptimizer)
    from opacus_dp.optimizers.adaclipoptimizer import AdaClipDPOptimizer as adaclip
    from opacus_dp.optimizers.optimizer import DPOptimizer as plain
    from opacus_dp.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping as fgc
    from opacus_dp.optimizers.perlayeroptimizer import DPPerLayerOptimizer as per_layer

    assert (plain, per_layer, adaclip, fgc) == (DPOptimizer, DPPerLayerOptimizer, AdaClipDPOptimizer,
                                                DPOptimizerFastGradientClipping)


def _two_passes(library, split_grad_samples):
    """A hand-built GradSampleModule and DPOptimizer (no make_private) with a hand-attached
    accountant; two backward passes before one step. Returns the update, k and the history."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    wrapped = library.GradSampleModule(model)
    optimizer = library.optimizers.DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=1.0), noise_multiplier=0.0,
                                               max_grad_norm=0.05, expected_batch_size=4)
    accountant = library.accountants.RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        wrapped(torch.randn(3, 3, generator=g, dtype=torch.float64)).pow(2).sum().backward()
    if split_grad_samples:  # Opacus 1.x's form of two passes: a list, one tensor per pass
        for p in model.parameters():
            p.grad_sample = list(torch.as_tensor(p.grad_sample).split(3)) if torch.is_tensor(p.grad_sample) \
                else p.grad_sample
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    update = [b - p.detach() for b, p in zip(before, model.parameters())]
    return update, optimizer.accumulated_iterations, accountant.history


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # Opacus's hooks on an input without grad
@pytest.mark.parametrize("split_grad_samples", [False, True])
def test_backward_passes_merged_without_make_private_count_as_batches_like_opacus(split_grad_samples):
    """Opacus 1.x: k backward passes before a step divide the mean by k·B and the accountant's
    hook records k·q; the same with opacus_dp's classes built by hand."""
    import opacus

    import opacus_dp

    ours = _two_passes(opacus_dp, split_grad_samples)
    theirs = _two_passes(opacus, split_grad_samples)
    assert ours[1:] == theirs[1:]
    for a, b in zip(ours[0], theirs[0]):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", ["DPOptimizer", "DPPerLayerOptimizer"])
def test_mean_without_expected_batch_size_is_refused_like_opacus(name):
    """Opacus 1.x refuses ``expected_batch_size=None`` with the mean reduction (the mean would
    divide by the sampled batch's size); ``loss_reduction='sum'`` needs none."""
    import opacus.optimizers

    import opacus_dp.optimizers

    for library in (opacus.optimizers, opacus_dp.optimizers):
        params = list(nn.Linear(3, 2).parameters())
        bound = 1.0 if name == "DPOptimizer" else [1.0, 1.0]
        with pytest.raises(ValueError, match="expected.batch.size"):
            getattr(library, name)(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=bound,
                                   expected_batch_size=None)
        optimizer = getattr(library, name)(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
                                           max_grad_norm=bound, expected_batch_size=None, loss_reduction="sum")
        assert optimizer.expected_batch_size is None


def test_expected_batch_size_set_to_none_later_never_steps_like_opacus():
    """Opacus 1.x cannot step after ``optimizer.expected_batch_size = None`` (mean reduction);
    opacus_dp refuses the assignment itself, keeping the divisor it had."""
    import opacus.optimizers

    import opacus_dp.optimizers

    for library in (opacus.optimizers, opacus_dp.optimizers):
        model = nn.Linear(3, 2)
        optimizer = library.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                        max_grad_norm=1.0, expected_batch_size=4)
        with pytest.raises((TypeError, ValueError), match="expected_batch_size|NoneType"):
            optimizer.expected_batch_size = None
            for p in model.parameters():
                p.grad_sample = torch.randn(3, *p.shape)
                p.grad = p.grad_sample.sum(0)
            optimizer.step()

"""A dropped per-sample wrapper (no ``close()``) is collected and leaves the user's model as it was.

Hooks on the user's layers refer to their wrapper weakly; a finalizer on the wrapper removes
every hook, ``p.grad_sample`` view, weight-gradient switch and ownership record.
"""

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from tests.distributed.cpu_data_parallel import CPUDataParallel
from tests.engine.helpers import per_sample_grads_oracle, small_data, small_model
from tests.grad_sample.test_gsm_lifecycle import snapshot

MODES = ("hooks", "functorch", "ghost", "bk")


def make_private(model, mode, clipping="flat", batch_size=6, engine=None):
    """``(wrapper, optimizer, criterion, loader)`` of ``make_private`` on ``model``."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(24, model[0].in_features, dtype=dtype)
    y = torch.randint(0, 2, (24,))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    n_params = len(list(model.parameters()))
    bound = [1.0] * n_params if clipping == "per_layer" else 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = (PrivacyEngine() if engine is None else engine).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=bound, grad_sample_mode=mode, clipping=clipping)
    if mode == "ghost":
        return out
    wrapper, optimizer, loader = out
    return wrapper, optimizer, nn.CrossEntropyLoss(), loader


def one_step(wrapper, optimizer, criterion, loader) -> None:
    x, y = next(iter(loader))  # the pass's first batch, even an empty one: every batch gets its step
    optimizer.zero_grad()
    criterion(wrapper(x), y).backward()
    optimizer.step()


def wrap_train_drop(model, mode, clipping="flat", engine=None) -> weakref.ref:
    """make_private, one step, then drop everything returned (no close()): the wrapper's weakref."""
    parts = make_private(model, mode, clipping, engine=engine)
    one_step(*parts)
    return weakref.ref(parts[0])


def clone_of(model):
    """A plain copy of ``model`` (``deepcopy`` would copy a live wrapper's hooks with it)."""
    reference = small_model()
    reference.load_state_dict(model.state_dict())
    return reference


def plain_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("keep_model", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_dropped_wrapper_is_collected(mode, keep_model, clipping):
    model = small_model()
    ref = wrap_train_drop(model, mode, clipping)
    model_ref = weakref.ref(model)
    if not keep_model:
        del model
    gc.collect()
    assert ref() is None
    assert (model_ref() is not None) == keep_model


@pytest.mark.filterwarnings("ignore:secure_mode")
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_soak_of_dropped_wrappers_frees_models_and_memory(mode):
    engine = PrivacyEngine()  # kept, as a training script keeps it

    def cycle():
        model = nn.Sequential(nn.Linear(128, 384), nn.Tanh(), nn.Linear(384, 2))  # ~200 KB
        ref = wrap_train_drop(model, mode, engine=engine)
        return ref, weakref.ref(model)

    for _ in range(20):  # warm-up: lazy imports, allocator pools, autograd caches
        cycle()
    gc.collect()
    before = _rss_bytes()
    refs = [ref for _ in range(200) for ref in cycle()]
    gc.collect()
    growth = _rss_bytes() - before
    assert all(r() is None for r in refs)
    # Each model holds ~200 KB of parameters, plus as much again of gradients and optimizer
    # state: 200 kept cycles would add > 80 MB. Freed cycles reuse the same allocator pools, so
    # RSS moves only by allocator noise (a few MB: arenas, fragmentation); 24 MB is well above
    # that noise and well below a third of the leak.
    assert growth < 24 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 200 dropped wrappers"


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_rewrapping_after_drop_gives_correct_per_sample_gradients(mode):
    model = small_model()
    make_private(model, mode)  # dropped at once, without close() nor gc.collect()
    ref = wrap_train_drop(model, mode)
    wrapper, optimizer, criterion, _ = make_private(model, mode)
    assert ref() is None
    x, y = small_data(6)
    criterion(wrapper(x), y).backward()
    expected = per_sample_grads_oracle(clone_of(model), x, y)
    params = list(model.parameters())
    if mode == "hooks":
        for p, g in zip(params, expected):
            torch.testing.assert_close(p.grad_sample, g)
    else:
        norms = wrapper.per_sample_norms(params)
        for n, g in zip(norms, expected):
            torch.testing.assert_close(n, g.reshape(len(g), -1).norm(dim=1))


@pytest.mark.parametrize("mode", MODES)
def test_plain_training_after_drop(mode):
    model = small_model()
    before = snapshot(model)
    wrap_train_drop(model, mode)
    gc.collect()
    assert snapshot(model) == before
    x, y = small_data(6)
    reference = clone_of(model)
    for g, e in zip(plain_grads(model, x, y), plain_grads(reference, x, y)):
        torch.testing.assert_close(g, e)
    assert all(p.requires_grad and not hasattr(p, "grad_sample") for p in model.parameters())
    old = [p.detach().clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(not torch.equal(p, o) for p, o in zip(model.parameters(), old))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
def test_dropped_wrapper_is_freed_without_the_garbage_collector(mode, clipping):
    """No reference cycle through the wrapper or its optimizer: ``del`` alone releases them, so
    the model trains plainly at once (a cycle would wait for a full collection, and until then
    the abandoned wrapper's hooks would keep ``p.grad`` None)."""
    model = small_model()
    x, y = small_data(6)
    parts = make_private(model, mode, clipping)
    one_step(*parts)
    refs = [weakref.ref(part) for part in parts[:2]]
    expected = plain_grads(clone_of(model), x, y)
    gc.collect()
    gc.disable()
    try:
        del parts
        assert all(ref() is None for ref in refs)
        for g, e in zip(plain_grads(model, x, y), expected):
            torch.testing.assert_close(g, e)
    finally:
        gc.enable()


def test_wrapper_kept_by_a_pending_graph_finishes_it_then_goes():
    model = small_model()
    wrapper = GradSampleModule(model, skip_weight_grads=True)
    ref = weakref.ref(wrapper)
    x, y = small_data(6)
    loss = nn.functional.cross_entropy(wrapper(x), y)
    del wrapper
    gc.collect()
    assert ref() is not None  # the graph's gradient hooks still need it
    loss.backward()
    for p, g in zip(model.parameters(), per_sample_grads_oracle(clone_of(model), x, y)):
        torch.testing.assert_close(p.grad_sample, g)
    del loss
    gc.collect()
    assert ref() is None
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def _pre_hooks(module):
    """``module``'s forward pre-hooks as ``(hook, takes_kwargs)``."""
    kw = module._forward_pre_hooks_with_kwargs
    return [(hook, i in kw) for i, hook in module._forward_pre_hooks.items()]


def _call_pre_hooks(module, hooks, x):
    """Call the ``(hook, takes_kwargs)`` as torch would; their results."""
    return [hook(module, (x,), {}) if kw else hook(module, (x,)) for hook, kw in hooks]


@pytest.mark.parametrize("wrapper_class", [GradSampleModule, BookkeepingGradSampleModule])
def test_hooks_of_a_collected_wrapper_pass_through(wrapper_class):
    """A hook called after its wrapper died (e.g. from a hook list copied during a forward
    that the collection interrupted) does nothing."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3).eval().requires_grad_(False))
    wrapper = wrapper_class(model, skip_weight_grads=True)
    layer, norm = model
    pre, guards = _pre_hooks(layer), _pre_hooks(norm)
    post = list(layer._forward_hooks.values())
    assert pre and guards and post
    del wrapper
    gc.collect()
    assert not layer._forward_pre_hooks and not norm._forward_pre_hooks
    x = torch.randn(5, 4)
    assert _call_pre_hooks(layer, pre, x) == [None] * len(pre)
    norm.train()  # a live wrapper would refuse this call
    assert _call_pre_hooks(norm, guards, torch.randn(5, 3)) == [None] * len(guards)
    output = layer(x)
    for hook in post:
        assert hook(layer, (x,), {}, output) is None
    assert all(p.requires_grad for p in layer.parameters())
    output.sum().backward()
    assert layer.weight.grad is not None and not hasattr(layer.weight, "grad_sample")


def test_rewrapping_after_dropping_a_wrapper_caught_in_a_reference_cycle():
    """A dropped wrapper that only the cycle collector frees is collected by the next wrap."""
    model = small_model()
    wrapper = GradSampleModule(model)
    wrapper._kept_by = [wrapper]  # a cycle through the wrapper (the user's, say)
    ref = weakref.ref(wrapper)
    gc.disable()
    try:
        del wrapper
        assert ref() is not None
        rewrapped = GradSampleModule(model)
        assert ref() is None
    finally:
        gc.enable()
    x, y = small_data(6)
    nn.functional.cross_entropy(rewrapped(x), y).backward()
    for p, g in zip(model.parameters(), per_sample_grads_oracle(clone_of(model), x, y)):
        torch.testing.assert_close(p.grad_sample, g)
    rewrapped.close()


def test_dropped_wrapper_gives_back_its_data_parallel():
    """The DataParallel inside the model is given back at collection (not only when the last
    wrapper goes), and the registration does not keep the wrapper alive."""
    other = GradSampleModule(small_model())  # keeps the DataParallel call hook installed
    inner = small_model()
    dp = CPUDataParallel(inner, 2)
    model = nn.Sequential(dp)
    wrapper = GradSampleModule(model)
    x, y = small_data(6)
    nn.functional.cross_entropy(wrapper(x), y).backward()
    assert "replicate" in dp.__dict__
    ref = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    assert ref() is None and "replicate" not in dp.__dict__
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    for g, e in zip(plain_grads(model, x, y), plain_grads(clone_of(inner), x, y)):
        torch.testing.assert_close(g, e)
    other.close()

"""nn.DataParallel: per-sample gradients from every replica, in batch order, on the masters.

On CPU the replicate → parallel_apply path is driven by ``CPUDataParallel`` (a real
``nn.DataParallel`` subclass whose device primitives run on CPU threads); with two or more
GPUs the same checks also run on torch's own ``nn.DataParallel``.
"""

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import _global_forward_pre_hooks

from opacus_dp import PrivacyEngine
from opacus_dp.distributed import data_parallel as dp_support
from opacus_dp.grad_sample import GradSampleModule
from tests.distributed.cpu_data_parallel import CPUDataParallel, replicate_on_cpu
from tests.distributed.oracle import clipped_mean_update, per_sample_grads, sgd_step

CUDA_REPLICAS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv1d(2, 3, kernel_size=3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5, 4), nn.Tanh(),
        nn.Linear(4, 3),
    ).double()


def batch(n: int = 7):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 2, 7, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (n,), generator=g)


def data_parallel(module: nn.Module, replicas: int, device: str) -> nn.DataParallel:
    if device == "cuda":
        return nn.DataParallel(module, device_ids=list(range(replicas)))
    return CPUDataParallel(module, num_replicas=replicas)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA_REPLICAS, reason="needs 2 GPUs"))]


def oracle_grad_samples(model, x, y):
    """Per-sample gradients from a batch-size-1 autograd loop (loss of sample i alone)."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    grads = per_sample_grads(model, loss_fn, x, y)
    return [torch.stack([g[k] for g in grads]) for k in range(len(grads[0]))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_grad_samples_gathered_in_batch_order(device, order, loss_reduction, replicas):
    if device == "cuda" and torch.cuda.device_count() < replicas:
        pytest.skip(f"needs {replicas} GPUs")
    model = make_model().to(device)
    x, y = (t.to(device) for t in batch(7))  # 7 rows: uneven chunks (4+3 or 3+3+1)
    want = oracle_grad_samples(model, x, y)
    if order == "before":
        gsm = GradSampleModule(data_parallel(model, replicas, device), loss_reduction=loss_reduction)
        run = gsm
    else:
        gsm = GradSampleModule(model, loss_reduction=loss_reduction)
        run = data_parallel(gsm, replicas, device)
    nn.CrossEntropyLoss(reduction=loss_reduction)(run(x), y).backward()
    for p, expected in zip(model.parameters(), want):
        assert p.grad_sample.shape == expected.shape
        torch.testing.assert_close(p.grad_sample, expected, rtol=1e-9, atol=1e-11)
    gsm.close()


def _private_update(model, x, y, engine_api: str, order: str, replicas: int, clipping, device):
    """Parameters after one σ=0 private step of ``model`` under DataParallel."""
    model, x, y = model.to(device), x.to(device), y.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = data_parallel(model, replicas, device) if order == "before" else model
        if engine_api == "classic":
            engine = PrivacyEngine(wrapped, batch_size=x.shape[0], sample_size=10 * x.shape[0],
                                   noise_multiplier=0.0, max_grad_norm=clipping,
                                   clip_per_layer=isinstance(clipping, list))
            engine.attach(optimizer)
            net = wrapped
        else:
            engine = PrivacyEngine(accountant="rdp")
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
            net, optimizer, _ = engine.make_private(
                module=wrapped, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0,
                max_grad_norm=clipping, poisson_sampling=False,
                clipping="per_layer" if isinstance(clipping, list) else "flat")
    if order == "after":
        net = data_parallel(net, replicas, device)
    optimizer.zero_grad()
    nn.CrossEntropyLoss()(net(x), y).backward()
    optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine_api,order,clipping", [
    ("modern", "before", 0.5), ("modern", "after", [0.3] * 6),
    ("classic", "before", [0.3] * 6), ("classic", "after", 0.5),
])
def test_private_step_equals_single_device(engine_api, order, clipping, device):
    x, y = batch(9)
    got = _private_update(make_model(), x, y, engine_api, order, 2, clipping, device)
    reference = make_model()
    norms = [torch.cat([g.flatten() for g in s]).norm() for s in
             per_sample_grads(reference, nn.CrossEntropyLoss(), x, y)]
    assert max(norms) > 0.5, "clipping must be active for this test to mean anything"
    update = clipped_mean_update(reference, nn.CrossEntropyLoss(), x, y, clipping, len(x))
    sgd_step(reference, update, lr=0.7)
    for p, q in zip(got, reference.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=1e-9, atol=1e-11)


class Custom(nn.Module):
    """A layer type with no registered grad sampler (uses the torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        return x * self.scale


def test_fallback_layers_are_refused_inside_replicas():
    refusal = r"1 \(Custom\) has no registered grad sampler.*DistributedDataParallel"
    with pytest.raises(ValueError, match=refusal):
        GradSampleModule(CPUDataParallel(nn.Sequential(nn.Linear(4, 3).double(), Custom()), 2))
    gsm = GradSampleModule(nn.Sequential(nn.Linear(4, 3).double(), Custom()))  # wrapped afterwards
    try:
        with pytest.raises(ValueError, match="no registered grad sampler"):
            CPUDataParallel(gsm, 2)(torch.randn(4, 4, dtype=torch.float64))
    finally:
        gsm.close()


def test_functorch_mode_is_refused_inside_replicas():
    with pytest.raises(ValueError, match="grad_sample_mode='functorch'"):
        GradSampleModule(CPUDataParallel(nn.Linear(4, 3).double(), 2), force_functorch=True)
    gsm = GradSampleModule(nn.Linear(4, 3).double(), force_functorch=True)
    try:
        with pytest.raises(ValueError, match="grad_sample_mode='functorch'"):
            CPUDataParallel(gsm, 2)(torch.randn(4, 4, dtype=torch.float64))
    finally:
        gsm.close()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_norms_only_modes_refuse_data_parallel(mode, order):
    """Their book-keeping keys a pass's calls by layer: two replicas' calls on different samples
    would be merged as one sample's (clipped together, a sensitivity of 2C). Refused before any
    backward pass, around the private model as inside it; the parameters stay as they were."""
    model, (x, y) = make_model(), batch(8)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.7)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    refusal = r"norms-only modes \('ghost', 'bk'\) do not support nn.DataParallel; use grad_sample_mode='hooks'"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if order == "before":
            with pytest.raises(ValueError, match=refusal):
                PrivacyEngine().make_private(module=CPUDataParallel(model, 2), optimizer=optimizer,
                                             data_loader=loader, noise_multiplier=0.0, max_grad_norm=0.5,
                                             poisson_sampling=False, grad_sample_mode=mode)
            return
        net, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=0.5,
            poisson_sampling=False, grad_sample_mode=mode)[:3]
    with pytest.raises(ValueError, match="called through a copy of the layer.*" + refusal):
        CPUDataParallel(net, 2)(x)
    optimizer.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start))
    net(x)  # the private model itself still runs


def test_replicas_made_elsewhere_are_refused():
    model = nn.Linear(4, 3).double()
    gsm = GradSampleModule(model)
    replica = replicate_on_cpu(model, 2)[1]
    try:
        with pytest.raises(ValueError, match="not made by nn.DataParallel.replicate"):
            replica(torch.randn(2, 4, dtype=torch.float64))
    finally:
        gsm.close()


@pytest.mark.parametrize("order", ["before", "after"])
def test_close_removes_every_trace(order):
    model = make_model()
    x, y = batch(4)
    if order == "before":
        dp = CPUDataParallel(model, 2)
        gsm = GradSampleModule(dp)
        run = gsm
    else:
        gsm = GradSampleModule(model)
        dp = run = CPUDataParallel(gsm, 2)
    nn.CrossEntropyLoss()(run(x), y).backward()
    assert "replicate" in dp.__dict__
    gsm.close()
    assert "replicate" not in dp.__dict__
    assert all(not hasattr(p, "grad_sample") for p in model.parameters())
    gc.collect()  # GradSampleModules of other tests that were never closed
    if not any(f.alive for f in dp_support._OWNERS.values()):
        assert dp_support._CALL_HOOK is None
        assert not any(h is dp_support._on_module_call for h in _global_forward_pre_hooks.values())


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_wrapper_collected_while_dynamo_compiles_other_code_leaves_the_hook_until_after(monkeypatch):
    """The garbage collector may finalise the last GradSampleModule while dynamo compiles another
    model; dynamo then builds guards on the global hooks it traced, so the call hook stays until
    the next module call outside the compilation (before: dynamo failed with a KeyError). Other
    tests' GradSampleModules may still be alive: this test starts from no owner and no hook."""
    monkeypatch.setattr(dp_support, "_OWNERS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(dp_support, "_CALL_HOOK", None)
    owners = [GradSampleModule(nn.Linear(2, 2))]
    (hook_id,) = dp_support.own_global_hook_ids()
    during = []

    def collecting_backend(graph_module, example_inputs):
        owners.clear()
        gc.collect()
        during.append(hook_id in _global_forward_pre_hooks)
        return graph_module.forward

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    x = torch.randn(2, 3)
    torch.testing.assert_close(torch.compile(model, backend=collecting_backend)(x), model(x))
    assert during == [True]  # kept while dynamo compiled
    assert dp_support._CALL_HOOK is None and hook_id not in _global_forward_pre_hooks  # removed by model(x)

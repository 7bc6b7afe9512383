"""Private training loops that do unusual (but legal) things with the model's tensors.

Each test runs one ``make_private`` step (σ = 0, plain SGD with lr = 1, so the parameter
change is the clipped, averaged gradient) and compares it with the float64 per-sample
autograd oracle (one backward pass per sample, clipped by hand), or checks that the step is
refused with a message naming the layer:

* several backward passes before one ``optimizer.step()`` (gradient accumulation): every
  mode averages over all the samples and the accountant counts every batch, as ``hooks``;
* a kept layer input modified in place between ``loss.backward()`` and ``optimizer.step()``
  (features returned by the model): the modes that keep inputs until the step (``bk``,
  ``auto``, ``ghost`` with a plain-tensor backward) refuse the step and update nothing, the
  others are unaffected; a reused data buffer refilled before the step (also through
  ``.data`` or NumPy) changes no mode's update;
* a layer input modified in place after the layer's forward call, before backward: refused
  (plain autograd refuses it too);
* ``torch.utils.checkpoint``, reentrant (a nested backward pass) or not: exact, one batch;
* in-place operations on the output of a ``Linear`` applied to 3-D input (residual ``y += h``,
  ``ReLU/SiLU/LeakyReLU(inplace=True)``): every parameter gets its exact update.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from tests.engine.helpers import clipped_sum_oracle
from tests.grad_sample.oracle import default_loss, oracle_grad_samples, trainable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ALL_MODES = ["hooks", "bk", "ghost", "auto"]
NORMS_ONLY_MODES = ["bk", "ghost", "auto"]
RTOL = 1e-5  # float32 private step against the float64 oracle


# ----------------------------------------------------------------------------- helpers
class QuadraticLoss(nn.Module):
    """``default_loss`` of each sample's output, reduced over the batch (a torch-style loss
    module with a ``reduction``, usable as the ghost mode's criterion)."""

    def __init__(self, reduction="mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, output, target=None):
        loss = default_loss(output)
        return loss / output.shape[0] if self.reduction == "mean" else loss


def first_output(output):
    return output[0] if isinstance(output, tuple) else output


def data(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def oracle_rows(model, x):
    """``(names, [per-sample gradients (B, *shape)])`` of a float64 copy of ``model`` (the
    loss is ``default_loss`` of its first output)."""
    m64 = copy.deepcopy(model).double()
    names = [n for n, _ in trainable(m64)]
    grads = oracle_grad_samples(m64, (x.double(),), loss_fn=lambda out: default_loss(first_output(out)))
    return names, [grads[n] for n in names]


def median_bound(rows, clipping):
    """A clipping bound that clips about half of the samples (flat or one per tensor)."""
    if clipping == "per_layer":
        return [g.reshape(len(g), -1).norm(dim=1).median().item() for g in rows]
    return torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in rows)).median().item()


def oracle_update(rows, bound, clipping, divisor):
    return [s / divisor for s in clipped_sum_oracle(rows, bound, clipping == "per_layer")]


def private(model, loader, mode, bound, reduction="mean", clipping="flat", **options):
    """``(engine, module, optimizer, criterion, loader)`` of a σ = 0 private run (``options``:
    further ``make_private`` arguments)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    result = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=bound, loss_reduction=reduction, clipping=clipping,
        poisson_sampling=False, grad_sample_mode=mode, criterion=QuadraticLoss(reduction), **options)
    assert len(result) == (4 if mode == "ghost" else 3)
    criterion = result[2] if mode == "ghost" else QuadraticLoss(reduction)
    return engine, result[0], result[1], criterion, result[-1]


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_update_matches(names, before, model, expected):
    """``before - after`` (the lr = 1 update) equals ``expected`` for every parameter of
    ``model`` (a module, or a list of parameters)."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    for name, b, p, e in zip(names, before, params, expected):
        assert e.abs().max() > 0, f"{name}: the oracle update must not be zero"
        torch.testing.assert_close((b - p.detach()).double(), e, rtol=RTOL,
                                   atol=RTOL * e.abs().max().item(), msg=lambda m: f"update of {name}: {m}")


def assert_unchanged(before, model):
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())), \
        "a refused step must not update any parameter"


# ------------------------------------------------- 1. several backward passes before one step
N_ACC, HALF = 12, 6


def mlp(seed=9, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3))


def accumulate(mode, make_loader):
    """Two forward/backward passes (the loader's two batches), then one step."""
    model, x = mlp(), data(N_ACC, 8)
    names, rows = oracle_rows(model, x)
    bound = median_bound(rows, "flat")
    expected = oracle_update(rows, bound, "flat", N_ACC)
    engine, gsm, optimizer, criterion, loader = private(model, make_loader(TensorDataset(x)), mode, bound)
    before = snapshot(model)
    optimizer.zero_grad()
    batches = 0
    for (xb,) in loader:
        criterion(gsm(xb)).backward()
        batches += 1
    assert batches == 2
    optimizer.step()
    assert_update_matches(names, before, model, expected)
    return engine, optimizer


@pytest.mark.parametrize("mode", ALL_MODES)
def test_two_passes_before_one_step_with_a_list_batch_sampler_count_as_two_batches(mode):
    """Two batches of a plain-list batch sampler, one step: the mean over all 12 samples,
    ``accumulated_iterations == 2`` and the same accountant history as ``hooks`` (rate 2·6/12)."""
    def make_loader(dataset):
        return DataLoader(dataset, batch_sampler=[list(range(HALF)), list(range(HALF, N_ACC))])

    engine, optimizer = accumulate(mode, make_loader)
    assert optimizer.accumulated_iterations == 2
    reference, _ = accumulate("hooks", make_loader)
    assert engine.accountant.history == reference.accountant.history
    [(sigma, rate, steps)] = engine.accountant.history
    assert rate == pytest.approx(2 * HALF / N_ACC) and steps == 1 and sigma == 0.0


@pytest.mark.parametrize("mode", ALL_MODES)
def test_two_passes_before_one_step_with_a_batch_size_loader(mode):
    """``DataLoader(batch_size=6)`` over 12 samples, two passes then one step: no "more than
    one logical batch" error, the update is the oracle's mean over the 12 samples."""
    _, optimizer = accumulate(mode, lambda ds: DataLoader(ds, batch_size=HALF))
    assert optimizer.accumulated_iterations == 2


# ------------------------------- 2. a kept input modified between loss.backward() and step()
D_KEEP = 32


class Body(nn.Module):
    """``body.0`` sees the data batch itself; ``head`` sees ``body``'s output ``feats``, which
    ``forward`` also returns (e.g. for logging)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_KEEP, D_KEEP), nn.Tanh())
        self.head = nn.Linear(D_KEEP, D_KEEP)

    def forward(self, x):
        feats = self.body(x)
        return self.head(feats), feats


REFILLS = {  # ways to refill a buffer; the last two bypass autograd's version counter
    "copy_": lambda buffer, new: buffer.copy_(new),
    "data": lambda buffer, new: buffer.data.copy_(new),
    "numpy": lambda buffer, new: buffer.numpy().__setitem__(slice(None), new.numpy()),
}


def buffer_loop(gsm, criterion, x, plain_backward, refill="copy_"):
    """A reused input buffer, refilled with the next batch after ``loss.backward()``."""
    buffer = torch.empty_like(x)
    buffer.copy_(x)
    loss = criterion(first_output(gsm(buffer)))
    (loss.value if plain_backward else loss).backward()
    REFILLS[refill](buffer, data(*x.shape, seed=7) * 50)


def features_loop(gsm, criterion, x, plain_backward):
    """The returned features, rescaled in place after ``loss.backward()``."""
    logits, feats = gsm(x)
    loss = criterion(logits)
    (loss.value if plain_backward else loss).backward()
    with torch.no_grad():
        feats.mul_(100.0)


LOOPS = {"reused_input_buffer": (buffer_loop, "body.0"), "returned_features": (features_loop, "head")}


def keep_setup(mode, batch):
    torch.manual_seed(0)
    model, x = Body(), data(batch, D_KEEP)
    names, rows = oracle_rows(model, x)
    bound = 0.5 * min(median_bound(rows, "flat"), 1.0)
    _, gsm, optimizer, criterion, _ = private(
        model, DataLoader(TensorDataset(x), batch_size=batch), mode, bound, reduction="sum")
    return model, x, names, rows, bound, gsm, optimizer, criterion


KEEPING_MODES = [("bk", False), ("auto", False), ("ghost", True)]


@pytest.mark.parametrize("mode, plain_backward", KEEPING_MODES)
def test_kept_input_modified_before_step_is_refused(mode, plain_backward):
    """bk / auto / ghost with a plain-tensor backward keep a layer's input until the step (no
    copy for an input from the autograd graph): the step raises, names the layer and updates
    nothing."""
    run, layer = LOOPS["returned_features"]
    model, x, _, _, _, gsm, optimizer, criterion = keep_setup(mode, 3)
    before = snapshot(model)
    run(gsm, criterion, x, plain_backward)
    with pytest.raises(RuntimeError, match="modified in place") as error:
        optimizer.step()
    assert layer in str(error.value)
    assert_unchanged(before, model)


class ReturnsPreActivation(nn.Module):
    """``fc2``'s input ``gelu(h)`` is kept as ``h`` (recomputed at the step, as ``h`` is also
    returned to the caller); the caller rescales ``h`` after ``loss.backward()``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_KEEP, D_KEEP), nn.Linear(D_KEEP, D_KEEP)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(nn.functional.gelu(h)), h


@pytest.mark.parametrize("mode, plain_backward", KEEPING_MODES)
def test_pre_activation_modified_before_step_is_refused(mode, plain_backward):
    """A kept input held as its activation's input ``h``: a change of ``h`` before the step
    is refused too (the clipped sum would use ``gelu`` of the new values)."""
    torch.manual_seed(0)
    model, x = ReturnsPreActivation(), data(3, D_KEEP)
    _, gsm, optimizer, criterion, _ = private(
        model, DataLoader(TensorDataset(x), batch_size=3), mode, 0.1, reduction="sum")
    before = snapshot(model)
    out, h = gsm(x)
    loss = criterion(out)
    (loss.value if plain_backward else loss).backward()
    kept = [type(a).__name__ for _, acts, _, _ in gsm._bookkeeper._resolved[0].ghost_calls for a in acts]
    assert "RecomputedInput" in kept, "fc2's input should be held as the GELU's input"
    with torch.no_grad():
        h.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified in place") as error:
        optimizer.step()
    assert "fc2" in str(error.value)
    assert_unchanged(before, model)


@pytest.mark.parametrize("refill", sorted(REFILLS))
@pytest.mark.parametrize("mode, plain_backward", KEEPING_MODES)
def test_data_buffer_refilled_before_step_is_harmless(mode, plain_backward, refill):
    """The modes that keep inputs until the step keep their own copy of a data batch (an input
    from outside the autograd graph): refilling the buffer before the step, also by means the
    version counter does not see, leaves the update the oracle's on the original values."""
    model, x, names, rows, bound, gsm, optimizer, criterion = keep_setup(mode, 3)
    expected = oracle_update(rows, bound, "flat", 1)
    before = snapshot(model)
    buffer_loop(gsm, criterion, x, plain_backward, refill)
    optimizer.step()
    assert_update_matches(names, before, model, expected)


class KeywordBody(Body):
    """``Body`` with its first layer called by keyword (``layer(input=x)``)."""

    def forward(self, x):
        feats = self.body[1](self.body[0](input=x))
        return self.head(feats), feats


@pytest.mark.parametrize("refill", ["data", "numpy"])
@pytest.mark.parametrize("mode, plain_backward", KEEPING_MODES)
def test_data_buffer_passed_by_keyword_and_refilled_before_step_is_harmless(
        mode, plain_backward, refill):
    """The copy of a kept data batch does not depend on how the layer was called."""
    torch.manual_seed(0)
    model, x = KeywordBody(), data(3, D_KEEP)
    names, rows = oracle_rows(model, x)
    bound = 0.5 * min(median_bound(rows, "flat"), 1.0)
    _, gsm, optimizer, criterion, _ = private(
        model, DataLoader(TensorDataset(x), batch_size=3), mode, bound, reduction="sum")
    before = snapshot(model)
    buffer_loop(gsm, criterion, x, plain_backward, refill)
    optimizer.step()
    assert_update_matches(names, before, model, oracle_update(rows, bound, "flat", 1))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_input_modified_after_backward_is_harmless_when_nothing_is_kept(mode, loop, batch):
    """hooks and the ghost criterion's two-pass backward finish the per-sample work within
    ``backward()``: the update is the oracle's on the original values, each sample ≤ C."""
    run, _ = LOOPS[loop]
    model, x, names, rows, bound, gsm, optimizer, criterion = keep_setup(mode, batch)
    expected = oracle_update(rows, bound, "flat", 1)
    before = snapshot(model)
    run(gsm, criterion, x, plain_backward=False)
    optimizer.step()
    assert_update_matches(names, before, model, expected)
    delta = torch.sqrt(sum(((b - p.detach()).double() ** 2).sum()
                           for b, p in zip(before, model.parameters())))
    assert delta <= batch * bound * (1 + 1e-6)  # sum reduction: each sample contributes ≤ C


# ------------------------------- 3. an input modified after the layer's call, before backward
class InplaceAfterLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_a = nn.Linear(8, 8)
        self.layer_b = nn.Linear(8, 4)

    def forward(self, x):
        a = nn.functional.gelu(self.layer_a(x))
        y = self.layer_b(a)
        a.mul_(3.0)  # layer_b's input, changed after layer_b used it
        return y + a[:, :4]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_input_modified_after_the_layer_call_is_refused(mode):
    """``a = gelu(h); y = layer_b(a); a.mul_(3)``: plain autograd refuses it, so does every
    mode (the norms-only ones naming ``layer_b``); nothing is updated."""
    torch.manual_seed(3)
    model, x = InplaceAfterLayer(), data(6, 8)
    with pytest.raises(RuntimeError):  # the precondition: plain autograd refuses this model
        default_loss(copy.deepcopy(model)(x)).backward()
    _, gsm, optimizer, criterion, _ = private(model, DataLoader(TensorDataset(x), batch_size=6), mode, 1.0)
    before = snapshot(model)
    with pytest.raises(RuntimeError) as error:
        criterion(gsm(x)).backward()
        optimizer.step()
    if mode != "hooks":  # hooks: autograd's own message about the saved tensor
        assert "modified in place" in str(error.value)
        assert "layer_b" in str(error.value)
    assert_unchanged(before, model)


# ------------------------------------------------------------- 4. torch.utils.checkpoint
class Checkpointed(nn.Module):
    """``a`` → checkpointed ``blk`` → ``c``; with ``last`` the checkpointed block is the end of
    the model (no layer records in the outer backward pass before the nested one), with
    ``twice`` a second checkpointed block follows."""

    def __init__(self, reentrant, last=False, twice=False):
        super().__init__()
        self.reentrant, self.last, self.twice = reentrant, last, twice
        self.a = nn.Linear(8, 8)
        self.blk = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.blk2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh()) if twice else None
        self.c = None if last else nn.Linear(8, 3)

    def forward(self, x):
        h = checkpoint.checkpoint(self.blk, torch.tanh(self.a(x)), use_reentrant=self.reentrant)
        if self.twice:
            h = checkpoint.checkpoint(self.blk2, h, use_reentrant=self.reentrant)
        return h if self.last else self.c(h)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("structure", ["middle", "last", "twice"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_checkpointed_blocks_equal_the_oracle(mode, reentrant, structure, reduction, clipping):
    """Activation checkpointing, reentrant (the block's gradients come from a nested backward
    pass, which belongs to the outer one) or not: the update is the oracle's clipped sum, and
    the step is one batch for the accountant."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant, last=structure == "last", twice=structure == "twice")
    x = data(6, 8)
    plain = copy.deepcopy(model)
    plain.reentrant = False  # the oracle's torch.autograd.grad cannot run reentrant checkpoints
    names, rows = oracle_rows(plain, x)
    bound = median_bound(rows, clipping)
    expected = oracle_update(rows, bound, clipping, len(x) if reduction == "mean" else 1)
    engine, gsm, optimizer, criterion, _ = private(
        model, DataLoader(TensorDataset(x), batch_size=6), mode, bound, reduction, clipping)
    before = snapshot(model)
    criterion(gsm(x)).backward()
    optimizer.step()
    assert_update_matches(names, before, model, expected)
    assert [q for _, q, _ in engine.accountant.history] == [1.0]


# --------------------------------------- 5. in-place ops on a Linear's output, 3-D input
B3, T3, D3 = 4, 3, 8


class InplaceResidual(nn.Module):
    """Transformer-style ``y = fc(h); y += h``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D3, D3)
        self.fc = nn.Linear(D3, D3)
        self.out = nn.Linear(D3, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = self.fc(h)
        y += h
        return self.out(y)


def inplace_activation(activation):
    return lambda: nn.Sequential(nn.Linear(D3, D3), activation(inplace=True), nn.Linear(D3, D3),
                                 activation(inplace=True), nn.Linear(D3, 4))


MODELS_3D = {"residual": InplaceResidual, "relu": inplace_activation(nn.ReLU),
             "silu": inplace_activation(nn.SiLU), "leaky_relu": inplace_activation(nn.LeakyReLU)}


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("kind", sorted(MODELS_3D))
def test_inplace_op_on_linear_output_with_3d_input_equals_the_oracle(kind, mode, reduction, clipping):
    """Every parameter, the in-place-followed Linear's included, gets the oracle's update."""
    torch.manual_seed(3)
    model, x = MODELS_3D[kind](), data(B3, T3, D3, seed=4)
    names, rows = oracle_rows(model, x)
    bound = median_bound(rows, clipping)
    expected = oracle_update(rows, bound, clipping, B3 if reduction == "mean" else 1)
    _, gsm, optimizer, criterion, _ = private(
        model, DataLoader(TensorDataset(x), batch_size=B3), mode, bound, reduction, clipping)
    before = snapshot(model)
    criterion(gsm(x)).backward()
    optimizer.step()
    assert_update_matches(names, before, model, expected)


# ------------------------------- 6. a parameter frozen for the backward pass, unfrozen before the step
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_parameter_unfrozen_between_backward_and_step_gets_no_update(mode, clipping):
    """A bias frozen during ``loss.backward()`` has no per-sample gradient in that step: after
    ``requires_grad_(True)`` before the step it must stay unchanged (not get an unclipped sum
    of the kept output gradients), and the others get the oracle's update without it."""
    torch.manual_seed(0)
    model, x = mlp(width=8), data(6, 8)
    frozen = model[0].bias
    frozen.requires_grad_(False)
    names, rows = oracle_rows(model, x)  # the trainable parameters of the backward pass
    bound = median_bound(rows, clipping)
    expected = oracle_update(rows, bound, clipping, len(x))
    frozen.requires_grad_(True)
    if clipping == "per_layer":  # one bound per parameter of the optimizer, the frozen one's too
        bound = bound[:1] + [bound[0]] + bound[1:]
    _, gsm, optimizer, criterion, _ = private(model, DataLoader(TensorDataset(x), batch_size=6), mode, bound,
                                              clipping=clipping)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen.requires_grad_(False)
    criterion(gsm(x)).backward()
    frozen.requires_grad_(True)
    optimizer.step()
    assert torch.equal(frozen.detach(), before["0.bias"]), "the frozen bias must not move"
    trained = dict(model.named_parameters())
    assert_update_matches(names, [before[n] for n in names], [trained[n] for n in names], expected)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_per_layer_bounds_stay_with_their_tensors_when_one_is_frozen(mode):
    """Per-layer clipping, ``0.weight`` frozen for good after ``make_private``: every other
    tensor keeps its own bound (not the bound of the tensor before it in the list of those
    trainable now), so the update is the oracle's with those bounds."""
    torch.manual_seed(0)
    model, x = mlp(width=8), data(6, 8)
    names_all, rows_all = oracle_rows(model, x)
    bounds = [0.5 * b for b in median_bound(rows_all, "per_layer")]
    bounds = [b * (1 + i) for i, b in enumerate(bounds)]  # all different: a shift would show
    model[0].weight.requires_grad_(False)
    names, rows = oracle_rows(model, x)  # the oracle of the step after freezing
    expected = oracle_update(rows, bounds[1:], "per_layer", len(x))
    model[0].weight.requires_grad_(True)
    _, gsm, optimizer, criterion, _ = private(model, DataLoader(TensorDataset(x), batch_size=6), mode, bounds,
                                              clipping="per_layer")
    model[0].weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    criterion(gsm(x)).backward()
    optimizer.step()
    trained = dict(model.named_parameters())
    assert torch.equal(trained["0.weight"].detach(), before["0.weight"])
    assert_update_matches(names, [before[n] for n in names], [trained[n] for n in names], expected)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_tensor_without_a_per_layer_bound_is_refused_by_name(mode):
    """A tensor frozen when the per-layer bounds were given and unfrozen later has no bound:
    the step names it (nothing is updated)."""
    torch.manual_seed(0)
    model, x = mlp(width=8), data(6, 8)
    model[2].bias.requires_grad_(False)
    _, gsm, optimizer, criterion, _ = private(model, DataLoader(TensorDataset(x), batch_size=6), mode,
                                              [0.1, 0.1, 0.1], clipping="per_layer")
    model[2].bias.requires_grad_(True)
    before = snapshot(model)
    criterion(gsm(x)).backward()
    with pytest.raises(ValueError, match=r"2\.bias.*no per-layer clipping bound"):
        optimizer.step()
    assert_unchanged(before, model)

"""σ = 0 user-level DP-SGD equals a hand-computed per-user oracle in every per-sample mode.

Each step: the users sampled, at most k of each user's examples, each user's gradient (mean or
sum of its examples' per-example gradients from an autograd loop) clipped as one to C (flat or
per layer), summed and divided by the expected number of users ⌊q·U⌋; then plain SGD. With
BatchMemoryManager the logical batch goes through several physical batches (each holding whole
users). A negative control checks that clipping per example instead gives another update.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.data.loader_facts import expected_batch_size_for
from tests.distributed.oracle import clipped_sum, per_sample_grads, sgd_step
from tests.privacy_units.models import N_USERS, make_data, make_model
from tests.privacy_units.oracle import unit_grads, unit_update

LR, K, STEPS = 0.5, 3, 3
MODES_SEEN = set()  # how the norms-only modes resolved the layers (ghost over a unit's rows, or materialised)


def _engine_run(kind, mode, clip, unit_gradient, physical):
    dataset, users = make_data(kind)
    model = make_model(kind)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(3)
    out = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=12),
        noise_multiplier=0.0, max_grad_norm=clip, grad_sample_mode=mode, privacy_unit="user",
        user_ids=users, max_examples_per_user=K, unit_gradient=unit_gradient,
        clipping="per_layer" if isinstance(clip, list) else "flat")
    private, dp_optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    return private, dp_optimizer, loader, criterion, reference


def _logical_steps(private, dp_optimizer, loader, criterion, physical):
    """Yield ``(x, y, unit sizes, pieces)`` of every logical step after taking it."""
    context = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=dp_optimizer) \
        if physical else None
    batches = context.__enter__() if context else loader
    xs, ys, sizes = [], [], []
    for x, y in batches:
        sizes += loader.unit_channel.latest().sizes()
        xs.append(x)
        ys.append(y)
        taken = dp_optimizer.steps_taken
        criterion(private(x), y).backward()
        MODES_SEEN.update(getattr(private, "layer_modes", dict)().values())
        dp_optimizer.step()
        dp_optimizer.zero_grad()
        if dp_optimizer.steps_taken > taken:
            yield torch.cat(xs), torch.cat(ys), sizes, len(xs)
            xs, ys, sizes = [], [], []
        if dp_optimizer.steps_taken == STEPS:
            break
    if context:
        context.__exit__(None, None, None)


CASES = [("mlp", mode, "flat", "mean", None) for mode in ("hooks", "functorch", "ghost", "bk", "auto")] + [
    ("mlp", "bk", "per-layer", "mean", None), ("mlp", "hooks", "per-layer", "sum", None),
    ("mlp", "ghost", "flat", "sum", None), ("conv", "hooks", "flat", "mean", None),
    ("conv", "bk", "per-layer", "mean", None), ("sequence", "ghost", "flat", "mean", None),
    ("sequence", "hooks", "flat", "sum", None), ("mlp", "hooks", "flat", "mean", 4),
    ("mlp", "bk", "flat", "mean", 5), ("conv", "ghost", "per-layer", "sum", 4),
    ("sequence", "bk", "flat", "mean", 3), ("wide_sequence", "bk", "flat", "mean", None),
    ("wide_sequence", "ghost", "per-layer", "sum", 5), ("wide_sequence", "hooks", "flat", "mean", None)]


@pytest.mark.parametrize("kind,mode,clipping,unit_gradient,physical", CASES)
def test_update_equals_per_user_oracle(kind, mode, clipping, unit_gradient, physical):
    n_tensors = len(list(make_model(kind).parameters()))
    clip = 0.05 if clipping == "flat" else [0.05] * n_tensors
    private, dp_optimizer, loader, criterion, reference = _engine_run(kind, mode, clip, unit_gradient, physical)
    divisor = expected_batch_size_for(N_USERS, loader.sample_rate)
    multi_row = pieces_seen = 0
    MODES_SEEN.clear()
    for x, y, sizes, pieces in _logical_steps(private, dp_optimizer, loader, criterion, physical):
        assert sum(sizes) == x.shape[0] and all(1 <= s <= K for s in sizes)
        multi_row += sum(s > 1 for s in sizes)
        pieces_seen = max(pieces_seen, pieces)
        sgd_step(reference, unit_update(reference, nn.functional.cross_entropy, x, y, sizes, clip, divisor,
                                        unit_gradient), LR)
        for p, q in zip([p for p in private.parameters() if p.requires_grad], reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    assert dp_optimizer.steps_taken == STEPS
    assert multi_row > 0, "no user contributed two rows: the grouping was not exercised"
    if physical:
        assert pieces_seen > 1, "BatchMemoryManager never split a logical batch"
    if mode in ("bk", "ghost") and kind in ("mlp", "wide_sequence"):
        assert "ghost" in MODES_SEEN, "no Linear layer took the per-unit ghost norm"


def test_per_example_clipping_is_a_different_update():
    """Negative control: the oracle tells user-level clipping from per-example clipping here."""
    dataset, users = make_data("mlp")
    model = make_model("mlp")
    x, y = dataset.tensors[0][:6], dataset.tensors[1][:6]
    rows = per_sample_grads(model, nn.functional.cross_entropy, x, y)
    params = list(model.parameters())
    per_user = clipped_sum(unit_grads(rows, [3, 3], "sum"), 0.05, params)
    per_example = clipped_sum(rows, 0.05, params)
    assert max((a - b).abs().max().item() for a, b in zip(per_user, per_example)) > 1e-3


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_empty_user_batches_take_noise_only_steps(mode):
    """q = 1/36 over 9 users: most draws are empty; each still steps (σ = 1: noise moves the
    parameters) and is accounted, and the nonempty ones match the oracle at σ = 0 elsewhere."""
    dataset, users = make_data("mlp")
    model = make_model("mlp")
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                              data_loader=DataLoader(dataset, batch_size=1), noise_multiplier=1.0, max_grad_norm=0.05,
                              grad_sample_mode=mode, privacy_unit="user", user_ids=users)
    private, optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    empty = 0
    for step, (x, y) in enumerate(loader):
        before = [p.detach().clone() for p in private.parameters()]
        empty += int(x.shape[0] == 0)
        criterion(private(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert all(not torch.equal(a, b) for a, b in zip(before, private.parameters()))
        if step == 7:
            break
    assert empty > 0 and engine.accountant.history == [(1.0, 1 / 36, 8)]


def test_calibration_targets_the_user_level_epsilon():
    """make_private_with_epsilon(privacy_unit="user"): σ such that the users' ε after the epochs is
    at most the target (and close to it), recomputed with a fresh accountant."""
    from opacus_dp.accountants import RDPAccountant

    dataset, users = make_data("mlp")
    model = make_model("mlp")
    engine = PrivacyEngine(accountant="rdp")
    _, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=DataLoader(dataset, batch_size=12),
        target_epsilon=4.0, target_delta=1e-5, epochs=5, max_grad_norm=1.0, privacy_unit="user", user_ids=users)
    check = RDPAccountant()
    check.history = [(optimizer.noise_multiplier, loader.sample_rate, 5 * len(loader))]
    assert 3.9 <= check.get_epsilon(1e-5) <= 4.0 and engine.accountant.privacy_unit == "user"


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_bfloat16_autocast_matches_the_float32_oracle(mode):
    """Under bfloat16 autocast the per-user norms and sums are formed in float32 from the bf16
    products: the update is the float32 oracle's within bfloat16 rounding (2⁻⁸ relative)."""
    private, dp_optimizer, loader, criterion, reference = _engine_run("wide_sequence", mode, 0.05, "mean", None)
    divisor = expected_batch_size_for(N_USERS, loader.sample_rate)
    for x, y in loader:
        if x.shape[0] > 2:
            break
    sizes = loader.unit_channel.latest().sizes()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = criterion(private(x).float(), y)
    loss.backward()
    dp_optimizer.step()
    sgd_step(reference, unit_update(reference, nn.functional.cross_entropy, x, y, sizes, 0.05, divisor), LR)
    for p, q in zip(private.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-2 * LR * 0.05 * 2)

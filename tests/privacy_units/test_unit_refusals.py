"""Bad input for privacy units is refused early, naming the argument; nothing trains silently with
another unit than the one asked for."""

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.maths.unit_groups import UnitLayoutError
from tests.privacy_units.models import make_data, make_model, stepped_batches


def _make(engine=None, **settings):
    dataset, users = make_data("mlp")
    model = make_model("mlp")
    engine = engine or PrivacyEngine()
    arguments = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     data_loader=DataLoader(dataset, batch_size=12), noise_multiplier=1.0, max_grad_norm=1.0,
                     privacy_unit="user", user_ids=users)
    arguments.update(settings)
    return engine, engine.make_private(**arguments)


@pytest.mark.parametrize("settings,error,match", [
    (dict(user_ids=list(range(35))), ValueError, "user_ids has 35 entries but the dataset has 36"),
    (dict(max_examples_per_user=0), ValueError, "max_examples_per_user must be an int ≥ 1"),
    (dict(privacy_unit="example"), ValueError, "user_ids applies only to privacy_unit='user'"),
    (dict(user_ids=None), ValueError, "needs user_ids"),
    (dict(privacy_unit="author"), ValueError, "privacy_unit must be one of"),
    (dict(poisson_sampling=False), ValueError, "poisson_sampling=False is not supported"),
    (dict(noise_mechanism="tree", epochs=1), NotImplementedError, "noise_mechanism='tree'"),
    (dict(augmentation_multiplicity=0, privacy_unit="example", user_ids=None), ValueError,
     "augmentation_multiplicity must be an int ≥ 1"),
    (dict(unit_gradient="max"), ValueError, "unit_gradient must be one of"),
])
def test_bad_settings_are_refused(settings, error, match):
    with pytest.raises(error, match=match):
        _make(**settings)


def test_a_batch_changed_before_the_backward_pass_is_refused():
    _, (private, optimizer, loader) = _make()
    for x, y in loader:
        if x.shape[0] > 1:
            break
    nn.functional.cross_entropy(private(x[:-1]), y[:-1]).backward()
    with pytest.raises(UnitLayoutError, match="rows"):
        optimizer.step()


def test_a_user_larger_than_the_physical_batch_is_refused():
    _, (private, optimizer, loader) = _make(max_examples_per_user=5)
    with pytest.raises(ValueError, match="max_physical_batch_size=2"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
            for _ in physical:
                pass


def test_one_history_never_mixes_units(tmp_path):
    engine, (private, optimizer, loader) = _make()
    x, y = next(iter(loader))
    nn.functional.cross_entropy(private(x), y).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="cannot add to it"):
        _make(engine=engine, privacy_unit="example", user_ids=None)
    path = tmp_path / "user.pt"
    engine.save_checkpoint(path=path, module=private, optimizer=optimizer)
    example_engine, (other, other_optimizer, _) = _make(privacy_unit="example", user_ids=None)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="privacy history per 'user'"):
        example_engine.load_checkpoint(path=path, module=other, optimizer=other_optimizer)
    assert example_engine.accountant.history == [] and all(
        torch.equal(a, b) for a, b in zip(before, other.parameters()))
    resumed, (again, again_optimizer, _) = _make()
    resumed.load_checkpoint(path=path, module=again, optimizer=again_optimizer)
    assert resumed.accountant.history == engine.accountant.history


def test_an_older_iterator_is_refused_after_a_newer_one():
    _, (_, _, loader) = _make()
    older = iter(loader)
    next(older)
    newer = iter(loader)
    next(newer)
    with pytest.raises(RuntimeError, match="older iterator"):
        next(older)


def test_secure_mode_samples_users_from_the_os():
    """secure_mode: the users' Poisson draws do not follow torch.manual_seed (two runs seeded alike
    draw different users), while without it they do."""
    def first_batches(secure: bool):
        torch.manual_seed(0)
        _, (private, optimizer, loader) = _make(engine=PrivacyEngine(secure_mode=secure))
        return stepped_batches(private, optimizer, loader, lambda x: x.clone())

    assert all(torch.equal(a, b) for a, b in zip(first_batches(False), first_batches(False)))
    secure = [first_batches(True) for _ in range(2)]
    assert any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(*secure))


def test_tensor_ids_group_by_value():
    """A list of one-element tensors (``list(users)``, ``[dataset[i][2] for i ...]``) names the
    same users as the 1-D tensor: tensors hash by identity, so grouping them as keys would make
    every example a user of its own (one user's examples clipped separately, at a rate above q)."""
    _, users = make_data("mlp")
    as_tensor = _make(user_ids=users)[1][2].batch_sampler.units
    as_list = _make(user_ids=list(users))[1][2].batch_sampler.units
    assert as_list == as_tensor and len(as_tensor) == len(set(users.tolist()))


@pytest.mark.parametrize("bad, match", [
    (lambda users: [float("nan")] + users.tolist()[1:], "user_ids\\[0\\] is NaN"),
    (lambda users: [torch.tensor([u, u]) for u in users.tolist()], "user_ids\\[0\\] is a tensor of shape \\(2,\\)"),
])
def test_ids_that_name_no_user_are_refused(bad, match):
    _, users = make_data("mlp")
    with pytest.raises(ValueError, match=match):
        _make(user_ids=bad(users))


def sorted_by_first_feature(rows):
    """A collate that sorts its rows (as a collate sorting by length for pack_padded_sequence does)."""
    rows = sorted(rows, key=lambda row: float(row[0][0]))
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


def test_a_collate_that_reorders_its_rows_is_refused():
    """Rows are grouped into users by position: a reordered row would be clipped with another
    user's examples (oracle: the same collate without sorting is accepted)."""
    dataset, users = make_data("mlp")
    model = make_model("mlp")
    arguments = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                     max_grad_norm=1.0, privacy_unit="user", user_ids=users)
    with pytest.raises(ValueError, match="reorders its rows"):
        PrivacyEngine().make_private(data_loader=DataLoader(dataset, batch_size=12, collate_fn=sorted_by_first_feature),
                                     **arguments)
    model = make_model("mlp")  # the same data with torch's collate, which keeps the order: accepted
    arguments.update(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    PrivacyEngine().make_private(data_loader=DataLoader(dataset, batch_size=12), **arguments)


def test_skipping_the_step_of_a_batch_of_users_is_refused():
    from opacus_dp.data.step_per_batch import SkippedBatchError

    _, (private, optimizer, loader) = _make(user_ids=make_data("mlp")[1])
    with pytest.raises(SkippedBatchError, match="got no optimizer.step"):
        for i, (x, y) in enumerate(loader):
            if i == 1:
                continue  # as `if len(x) == 0: continue` would
            optimizer.zero_grad()
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
    assert optimizer.steps_taken == 1

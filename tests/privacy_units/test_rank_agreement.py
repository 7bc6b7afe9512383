"""The ranks' sampling of privacy units must agree (2 gloo processes).

``set_epoch`` on some ranks only: the ranks would own overlapping shards, so one user (or example)
would be in two ranks' batches and clipped on each. The first step of such a pass is refused on
every rank with nothing applied or accounted; the same epoch on every rank trains, with no user in
two ranks' batches (checked from the rows each rank received). Ranks given different
``max_examples_per_user`` or ``unit_gradient`` are refused at ``make_private`` (the ranks draw every
user's rows from one shared stream, which a different ``k`` makes diverge)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.distributed import RanksOutOfStepError
from tests.distributed.spawn import run_on_ranks
from tests.privacy_units.models import make_data, make_model

pytestmark = pytest.mark.distributed
WORLD, STEP_TIMEOUT_S = 2, 10  # below the process group's 30 s (tests/distributed/spawn.py)
CASES = (("ddp", "user"), ("ddp", "example"), ("fsdp", "user"))


def _params(module):
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in module.parameters()]


def _pass(wrapper, unit, epochs):
    """One pass with ``epochs[rank]`` set on the sampler: the rows of each batch, the error, the
    parameters before and after, the accountant's history."""
    dataset, users = make_data("mlp")
    model = make_model("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        torch.manual_seed(3)
        model = DistributedDataParallel(model) if wrapper == "ddp" else model
        private, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(dataset, batch_size=9), noise_multiplier=0.0, max_grad_norm=1.0,
            fsdp=wrapper == "fsdp", step_timeout=STEP_TIMEOUT_S,
            **(dict(privacy_unit="user", user_ids=users) if unit == "user" else {}))
    before = _params(private)
    loader.batch_sampler.set_epoch(epochs[torch.distributed.get_rank()])
    rows, error = [], None
    try:
        for x, y in loader:
            rows.append([int((dataset.tensors[0] == row).all(1).nonzero()) for row in x])
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    except RanksOutOfStepError as caught:
        error = str(caught)
    return dict(rows=rows, error=error, before=before, after=_params(private),
                history=list(engine.accountant.history))


def _settings_refusal(rank, name, values):
    """make_private's error on this rank when the ranks pass different ``name`` values (None: accepted)."""
    dataset, users = make_data("mlp")
    model = DistributedDataParallel(make_model("mlp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            PrivacyEngine(accountant="rdp").make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=DataLoader(dataset, batch_size=9), noise_multiplier=0.0, max_grad_norm=1.0,
                privacy_unit="user", user_ids=users, step_timeout=STEP_TIMEOUT_S, **{name: values[rank]})
        except ValueError as error:
            return str(error)
    return None


SETTINGS = (("max_examples_per_user", (2, 3)), ("unit_gradient", ("mean", "sum")))


def job(rank, world_size):
    runs = {(wrapper, unit, agree): _pass(wrapper, unit, [1, 1] if agree else [1, 0])
            for wrapper, unit in CASES for agree in (True, False)}
    runs.update({name: _settings_refusal(rank, name, values) for name, values in SETTINGS})
    return runs


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(job, WORLD, timeout=240)


@pytest.mark.parametrize("wrapper,unit", CASES)
def test_set_epoch_on_one_rank_only_is_refused_before_anything_is_applied(reports, wrapper, unit):
    for rank in reports:
        run = rank[(wrapper, unit, False)]
        assert run["error"] is not None and "set_epoch" in run["error"]
        assert len(run["rows"]) == 1 and run["history"] == []
        for b, a in zip(run["before"], run["after"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("wrapper,unit", CASES)
def test_the_same_epoch_on_every_rank_trains_with_disjoint_units(reports, wrapper, unit):
    _, users = make_data("mlp")
    unit_of = users.tolist() if unit == "user" else list(range(len(users)))
    runs = [rank[(wrapper, unit, True)] for rank in reports]
    assert all(run["error"] is None for run in runs)
    assert runs[0]["history"] == runs[1]["history"] and runs[0]["history"][0][2] == len(runs[0]["rows"]) > 0
    for mine, theirs in zip(runs[0]["rows"], runs[1]["rows"]):
        assert not {unit_of[i] for i in mine} & {unit_of[i] for i in theirs}


@pytest.mark.parametrize("name", [name for name, _ in SETTINGS])
def test_ranks_with_different_unit_settings_are_refused(reports, name):
    for rank in reports:
        assert rank[name] is not None and name in rank[name]

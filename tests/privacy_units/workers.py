"""Rank functions of the distributed user-level tests (2 gloo processes): users sharded across the
ranks by the engine's loader, σ = 0, BatchMemoryManager, under DPDDP, DDP and FSDP2."""

import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel
from tests.privacy_units.models import make_data, make_model

LR, C, K, STEPS, PHYSICAL = 0.5, 0.05, 3, 3, 4


def _full(module):
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in module.parameters()]


def _train(model, mode, fsdp, user_ids, unit_gradient="mean", multiplicity=1):
    dataset, _ = make_data("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    torch.manual_seed(11)
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                              data_loader=DataLoader(dataset, batch_size=12), noise_multiplier=0.0, max_grad_norm=C,
                              grad_sample_mode=mode, fsdp=fsdp, unit_gradient=unit_gradient,
                              augmentation_multiplicity=multiplicity,
                              **(dict(privacy_unit="user", user_ids=user_ids, max_examples_per_user=K)
                                 if user_ids is not None else {}))
    private, optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    logical, xs, ys, sizes = [], [], [], []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL, optimizer=optimizer) as batches:
        for x, y in batches:
            sizes += loader.unit_channel.latest().sizes()
            xs.append(x)
            ys.append(y)
            criterion(private(x), y).backward()
            taken = optimizer.steps_taken
            optimizer.step()
            optimizer.zero_grad()
            if optimizer.steps_taken > taken:
                logical.append((torch.cat(xs), torch.cat(ys), sizes, len(xs)))
                xs, ys, sizes = [], [], []
            if len(logical) == STEPS:
                break
    return {"steps": logical, "final": _full(private), "divisor": optimizer.expected_batch_size * 2,
            "rate": loader.sample_rate,
            "history": list(engine.accountant.history), "unit": engine.accountant.privacy_unit}


def user_level_job(rank, world_size):
    """Every configuration's report on this rank, and the refusal of ranks given other user_ids."""
    _, users = make_data("mlp")
    reports = {}
    for name, mode in (("dpddp-hooks", "hooks"), ("ddp-bk", "bk")):
        model = make_model("mlp")
        start = _full(model)
        wrapped = DifferentiallyPrivateDistributedDataParallel(model) if name.startswith("dpddp") \
            else DistributedDataParallel(model)
        reports[name] = dict(_train(wrapped, mode, False, users), start=start)
    model = make_model("mlp")
    start = _full(model)
    reports["fsdp-bk"] = dict(_train(model, "bk", True, users, unit_gradient="sum"), start=start)
    model = make_model("mlp")
    start = _full(model)
    reports["ddp-augmult"] = dict(_train(DistributedDataParallel(model), "bk", False, None, multiplicity=2),
                                  start=start)
    try:
        _train(DistributedDataParallel(make_model("mlp")), "hooks", False, users.roll(rank))
        reports["refusal"] = None
    except ValueError as error:
        reports["refusal"] = str(error)
    return reports

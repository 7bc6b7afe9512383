"""The matrix of pinned private training runs and the loop each one runs (on every rank).

A case is 3 logical steps of DP training with σ > 0 (noise drawn from a seeded ``noise_generator``)
and clipping active, SGD with momentum (one case: Adam), on a tiny model of :mod:`.models`. Its axes:
grad_sample_mode × clipping (flat, per_layer, adaptive) × noise mechanism (independent, banded,
tree, blt; flat clipping) × accountant (rdp, prv, gdp) × API (``make_private``,
``make_private_with_epsilon``, classic ``attach`` with ``virtual_step``) × loop (plain,
BatchMemoryManager) × reduction (local; DPDDP and FSDP2 on 2 gloo processes). The matrix is pruned
to one representative per interaction worth pinning.

A case reports the final parameters (whole, gathered from FSDP2 shards), every ``p.grad`` after the
last step, ε at δ = 1e-5, the accountant's history, and the optimizer's ``noise_multiplier`` and
``max_grad_norm``; or ``{"error": ...}`` if the library raised. Setting the environment variable
``PIN_BEHAVIOUR_PERTURB_LR=1`` moves every learning rate up by one float32 ulp (to show that a change
is seen; one float64 ulp would vanish when torch rounds the rate to the float32 parameters).
"""

import math
import os
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus_dp.maths.cpu_products import cpu_products_set_to
from tests.pinning.models import N_SAMPLES, dataset, make_model

STEPS, DELTA, SIGMA, CLIP, LAYER_CLIP = 3, 1e-5, 0.9, 0.4, 0.25
BATCH, PHYSICAL, BANDS, EPOCHS = 8, 3, 2, 2
ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.3, min_clipbound=0.05,
                max_clipbound=4.0, unclipped_num_std=3.0)
STEP_TIMEOUT_S = 20.0  # below the 30 s of the spawned process groups (tests/distributed/spawn.py)
PERTURB_ENV = "PIN_BEHAVIOUR_PERTURB_LR"


@dataclass(frozen=True)
class Case:
    reduction: str = "local"        # local | ddp | fsdp2
    model: str = "mlp"              # see tests/pinning/models.py
    mode: str = "hooks"             # grad_sample_mode
    clipping: str = "flat"          # flat | per_layer | adaptive
    mechanism: str = "independent"  # independent | banded | tree | blt
    accountant: str = "rdp"         # rdp | prv | gdp
    api: str = "make_private"       # make_private | with_epsilon | classic
    loop: str = "plain"             # plain | bmm
    optim: str = "sgd"              # sgd (momentum 0.9) | adam

    @property
    def name(self) -> str:
        return "-".join((self.reduction, self.model, self.mode, self.clipping, self.mechanism, self.accountant,
                         self.api, self.loop, self.optim))


def _local_cases():
    cases = [Case(mode=m, clipping=c) for m in ("hooks", "functorch", "ghost", "bk")
             for c in ("flat", "per_layer", "adaptive")]
    cases += [Case(model="conv", mode=m) for m in ("hooks", "functorch", "ghost", "bk")]
    cases += [Case(model="lstm", mode="hooks"), Case(model="lstm", mode="hooks", clipping="per_layer"),
              Case(model="bert", mode="hooks")]
    cases += [Case(mode=m, mechanism=k) for m in ("hooks", "bk") for k in ("banded", "tree", "blt")]
    cases += [Case(accountant=a) for a in ("prv", "gdp")]
    cases += [Case(api="with_epsilon"), Case(api="with_epsilon", accountant="prv", mode="bk")]
    cases += [Case(api="classic"), Case(api="classic", clipping="per_layer")]
    cases += [Case(loop="bmm"), Case(loop="bmm", mode="bk"), Case(loop="bmm", mode="ghost", mechanism="banded")]
    return cases + [Case(optim="adam"), Case(optim="adam", mode="bk")]


def _ddp_cases():
    cases = [Case("ddp", mode=m) for m in ("hooks", "functorch", "ghost", "bk")]
    cases += [Case("ddp", clipping=c) for c in ("per_layer", "adaptive")]
    cases += [Case("ddp", mechanism=k) for k in ("banded", "tree", "blt")]
    cases += [Case("ddp", loop="bmm"), Case("ddp", loop="bmm", mode="bk"), Case("ddp", api="classic"),
              Case("ddp", api="with_epsilon"), Case("ddp", accountant="prv")]
    return cases


def _fsdp2_cases():  # FSDP2 refuses correlated noise and adaptive clipping (docs/distributed.md)
    cases = [Case("fsdp2", mode=m) for m in ("bk", "ghost", "hooks", "functorch")]
    return cases + [Case("fsdp2", mode="bk", clipping="per_layer"), Case("fsdp2", mode="hooks", clipping="per_layer"),
                    Case("fsdp2", mode="bk", loop="bmm"), Case("fsdp2", api="classic"),
                    Case("fsdp2", mode="bk", optim="adam")]


CASES = {"local": _local_cases(), "ddp": _ddp_cases(), "fsdp2": _fsdp2_cases()}
WORLD_SIZE = {"local": 1, "ddp": 2, "fsdp2": 2}


def _learning_rate(case: Case) -> float:
    lr = 0.01 if case.optim == "adam" else 0.1
    if os.environ.get(PERTURB_ENV) != "1":
        return lr
    up = torch.tensor(lr, dtype=torch.float32)  # one float32 ulp: the parameters' precision
    return float(torch.nextafter(up, torch.tensor(math.inf)))


def _optimizer(case: Case, module: nn.Module):
    if case.optim == "adam":
        return torch.optim.Adam(module.parameters(), lr=_learning_rate(case))
    return torch.optim.SGD(module.parameters(), lr=_learning_rate(case), momentum=0.9)


def _bound(case: Case, module: nn.Module):
    if case.clipping == "per_layer":
        return [LAYER_CLIP] * sum(1 for p in module.parameters() if p.requires_grad)
    return CLIP


def _loader(case: Case, world_size: int) -> DataLoader:
    data = dataset(case.model)
    if case.reduction == "ddp":
        return DataLoader(data, batch_size=BATCH // world_size, sampler=DistributedSampler(data, shuffle=False))
    return DataLoader(data, batch_size=BATCH)


def _options(case: Case) -> dict:
    options = dict(clipping=case.clipping, grad_sample_mode=case.mode, noise_mechanism=case.mechanism,
                   fsdp=case.reduction == "fsdp2", noise_generator=torch.Generator().manual_seed(5))
    if case.clipping == "adaptive":
        options.update(ADAPTIVE)
    if case.mechanism == "banded":
        options["bands"] = BANDS
    if case.reduction != "local":
        options["step_timeout"] = STEP_TIMEOUT_S
    return options


def _modern(case: Case, model: nn.Module, rank: int, world_size: int):
    """``(engine, module, optimizer, criterion, loader)`` of ``make_private[_with_epsilon]``."""
    engine = PrivacyEngine(accountant=case.accountant)
    optimizer, options = _optimizer(case, model), _options(case)
    torch.manual_seed(11 + rank)  # each rank draws its own Poisson batches
    common = dict(module=model, optimizer=optimizer, data_loader=_loader(case, world_size),
                  max_grad_norm=_bound(case, model), **options)
    if case.api == "with_epsilon":
        out = engine.make_private_with_epsilon(target_epsilon=3.0, target_delta=DELTA, epochs=EPOCHS, **common)
    else:
        epochs = {"epochs": EPOCHS} if case.mechanism != "independent" else {}
        out = engine.make_private(noise_multiplier=SIGMA, **epochs, **common)
    criterion = out[2] if case.mode == "ghost" else nn.CrossEntropyLoss()
    return engine, out[0], out[1], criterion, out[-1]


def _classic(case: Case, model: nn.Module, world_size: int):
    """The classic engine attached to the user's optimizer; ``(engine, model, optimizer, loss, None)``.
    ``batch_size`` is per process, as in Opacus 0.x."""
    optimizer = _optimizer(case, model)
    engine = PrivacyEngine(model, batch_size=BATCH // world_size, sample_size=N_SAMPLES, noise_multiplier=SIGMA,
                           max_grad_norm=CLIP, clip_per_layer=case.clipping == "per_layer",
                           noise_generator=torch.Generator().manual_seed(5), grad_sample_mode=case.mode,
                           fsdp=case.reduction == "fsdp2")
    engine.attach(optimizer)
    return engine, model, optimizer, nn.CrossEntropyLoss(), None


def _steps(engine) -> int:
    return len(engine.accountant)


def _train_classic(case, engine, module, optimizer, criterion, rank, world_size):
    """Each step: two physical batches of this rank's rows, ``virtual_step`` then ``step``."""
    x, y = dataset(case.model).tensors
    half = BATCH // (2 * world_size)
    for step in range(STEPS):
        for part in range(2):
            start = ((step * 2 + part) * world_size + rank) * half % (N_SAMPLES - half)
            optimizer.zero_grad()
            criterion(module(x[start:start + half]), y[start:start + half]).backward()
            optimizer.virtual_step() if part == 0 else optimizer.step()


def _train(case, engine, module, optimizer, criterion, loader):
    """``STEPS`` logical steps (counted by the accountant); BatchMemoryManager cuts pieces of 3."""
    def one(x, y):
        optimizer.zero_grad()
        criterion(module(x), y).backward()
        optimizer.step()
        return _steps(engine) >= STEPS

    if case.loop == "bmm":
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL, optimizer=optimizer) as pieces:
            for x, y in pieces:
                if one(x, y):
                    return
        raise RuntimeError(f"one pass of BatchMemoryManager made fewer than {STEPS} steps")
    while True:
        for x, y in loader:
            if one(x, y):
                return


def _whole(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().clone()


def _plain(value):
    """A tensor bound (adaptive clipping may keep one) as a float; lists element-wise."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return float(value) if isinstance(value, torch.Tensor) else value


def _report(case, engine, module, optimizer) -> dict:
    classic = case.api == "classic"  # the classic engine holds σ and C (the user's optimizer does not)
    epsilon = engine.get_privacy_spent(DELTA)[0] if classic else engine.get_epsilon(DELTA)
    holder = engine if classic else optimizer
    return {"params": [_whole(p) for p in module.parameters()],
            "grads": [None if p.grad is None else _whole(p.grad) for p in module.parameters()],
            "epsilon": float(epsilon), "history": [tuple(e) for e in engine.accountant.history],
            "noise_multiplier": _plain(holder.noise_multiplier), "max_grad_norm": _plain(holder.max_grad_norm)}


def run_case(case: Case, rank: int = 0, world_size: int = 1) -> dict:
    """Train ``case`` on this rank and report (see module doc); raises what the library raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model(case.model)
        if case.reduction == "ddp":
            model = DifferentiallyPrivateDistributedDataParallel(model)
        if case.api == "classic":
            engine, module, optimizer, criterion, _ = _classic(case, model, world_size)
            _train_classic(case, engine, module, optimizer, criterion, rank, world_size)
        else:
            engine, module, optimizer, criterion, loader = _modern(case, model, rank, world_size)
            _train(case, engine, module, optimizer, criterion, loader)
        return _report(case, engine, module, optimizer)


def _error(error: BaseException) -> str:
    where = traceback.extract_tb(error.__traceback__)[-3:]
    return f"{type(error).__name__}: {error} (at " + "; ".join(f"{f.filename}:{f.lineno}" for f in where) + ")"


def run_cases(rank: int, world_size: int, reduction: str, names=None) -> dict:
    """``{name: report or {"error": ...}}`` for the cases of ``reduction`` (those in ``names``).
    Under a process group, the cases after one that raised are not run (the ranks may be out of
    step): each reports an error naming the case that failed."""
    with cpu_products_set_to("torch"):  # the pinned bits are those of torch's products
        return _run_cases(rank, world_size, reduction, names)


def _run_cases(rank: int, world_size: int, reduction: str, names) -> dict:
    results, failed = {}, None
    for case in CASES[reduction]:
        if names is not None and case.name not in names:
            continue
        if failed is not None:
            results[case.name] = {"error": f"not run: the earlier case {failed} failed on rank {rank}"}
            continue
        try:
            results[case.name] = run_case(case, rank, world_size)
        except Exception as error:  # reported per case; the comparison fails that case
            results[case.name] = {"error": _error(error)}
            failed = case.name if world_size > 1 else None
    return results

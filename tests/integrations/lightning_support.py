"""Shared pieces of the Lightning integration tests: a recording LightningModule, a Trainer factory,
the per-example clipping oracle, and the 2-process worker (spawned by tests/distributed/spawn.py)."""

import os
import tempfile
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.integrations.lightning import DPCallback, PrivateDataLoader

N, FEATURES, CLASSES, BATCH, LR = 64, 8, 3, 16, 0.5


def data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=generator)
    return x, torch.randint(0, CLASSES, (N,), generator=generator)


class Recorder(pl.LightningModule):
    """A small classifier that records, at each training step, its parameters and the batch it got."""

    def __init__(self, x, y, optimizers: int = 1, manual: bool = False, private_loader: bool = True,
                 num_workers: int = 0, batch_size: int = BATCH):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
        self.x, self.y = x, y
        self.n_optimizers, self.private_loader = optimizers, private_loader
        self.num_workers, self.batch_size = num_workers, batch_size
        self.automatic_optimization = not manual
        self.records = []  # (parameters before the step, x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.records.append(([p.detach().clone() for p in self.net.parameters()], x.clone(), y.clone()))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=LR) for _ in range(self.n_optimizers)]

    def train_dataloader(self):
        loader = DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, num_workers=self.num_workers)
        return PrivateDataLoader(loader) if self.private_loader else loader


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint`` at the end of global step ``step``."""

    def __init__(self, step: int, path):
        self.step, self.path = step, str(path)

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def trainer(callbacks, epochs: int = 2, **options) -> pl.Trainer:
    """A CPU Trainer; its default checkpoints (``enable_checkpointing=True`` without a directory) go
    to a temporary directory, not the working directory."""
    settings = dict(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    default_root_dir=tempfile.mkdtemp(prefix="opacus_dp_lightning_"))
    settings.update(options)
    return pl.Trainer(callbacks=callbacks, **settings)


def fit(module, callbacks, ckpt_path=None, **options) -> pl.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = trainer(callbacks, **options)
        run.fit(module, ckpt_path=ckpt_path)
    return run


def clipped_sum(params, x, y, bound: float):
    """Σ_i clip_C(∇ℓ_i) by an autograd loop over single examples (ℓ_i: cross-entropy of example i)."""
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
    with torch.no_grad():
        for p, value in zip(net.parameters(), params):
            p.copy_(value)
    total = [torch.zeros_like(p, dtype=torch.float64) for p in net.parameters()]
    for i in range(len(y)):
        grads = torch.autograd.grad(F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), list(net.parameters()))
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = min(1.0, bound / float(norm))
        total = [t + factor * g.double() for t, g in zip(total, grads)]
    return total


# ---------------------------------------------------------------------------- 2 processes
def ddp_worker(rank: int, world_size: int, bound: float, sigma: float, compiled: bool = False):
    """One rank of a Lightning DDP run (the gloo process group exists already): two fits, σ = 0 and
    σ = ``sigma``; returns each rank's records, final parameters and ε. ``compiled``: one fit, σ = 0,
    of the module compiled (``torch.compile(module, backend="eager")``); also returns the tapped
    calls of each step and dynamo's graph breaks."""
    from torch._dynamo.utils import counters

    from tests.compile.helpers import watch_tapped_calls

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    tapped = []
    if compiled:
        watch_tapped_calls(setattr, lambda records: tapped.append(len(records)))
        counters.clear()
    results = {}
    for name, noise in (("clipped", 0.0), ("noised", sigma))[:1 if compiled else 2]:
        pl.seed_everything(0)
        x, y = data()
        module = Recorder(x, y)
        callback = DPCallback(target_delta=1e-5, max_grad_norm=bound, noise_multiplier=noise, accountant="rdp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = trainer([callback], epochs=1, strategy="ddp", devices=world_size)
            run.fit(torch.compile(module, backend="eager") if compiled else module)
        results[name] = {
            "records": module.records,
            "final": [p.detach().clone() for p in module.net.parameters()],
            "epsilon": float(run.callback_metrics["epsilon"]) if noise > 0 else None,
            "history": list(callback.privacy_engine.accountant.history),
        }
    results.update(tapped=tapped, breaks=sum(counters["graph_break"].values()))
    return results

#!/usr/bin/env python3
"""DCGAN (Radford et al. 2016) whose discriminator is trained with DP-SGD.

Only the discriminator D touches the private images, so only D is private. The generator G
is trained non-privately from D's outputs on generated images: G depends on the private data
only through D, which is differentially private, so G (and every image it produces) is
post-processing and inherits D's (ε, δ) (the DP-GAN argument, Xie et al. 2018).

One iteration per Poisson batch of real images ``x`` (one private step of D):

1. D step — a single private backward on the concatenation ``[x ; G(z).detach()]`` with
   labels ``[1 ; 0]``. Every row is one sample for per-sample clipping; the number F of fake
   rows is fixed (the expected per-process batch size), so fakes do not depend on which
   private examples were drawn, and adding or removing one private example changes the
   clipped sum by at most C: σC noise covers it. (Two backwards would need the per-sample
   state of the first kept across the second; one backward keeps the bookkeeping trivial.)
   D uses GroupNorm, which normalises each sample on its own (BatchNorm would mix them).
2. G step — non-private: ``D(G(z))`` with label 1, back-propagated into G only. D's
   parameters are frozen and its per-sample hooks disabled meanwhile, so no gradient or
   per-sample state of D is produced, and G's gradients never reach the DP optimizer.

Datasets (``--dataset``): ``cifar10``, ``mnist`` (``--target-digit`` keeps one digit),
``folder`` (``torchvision.datasets.ImageFolder``), ``fake`` (``FakeData``) and ``digits``
(scikit-learn's shipped 8×8 digits, no download). Outputs in ``--outf`` (by default
``$XDG_CACHE_HOME/opacus_dp/examples/dcgan``, see ``common/cli.py``): ``real_samples.png``
(a grid of *private* training images, for visual comparison only), ``fake_samples_epoch_NNN.png``
from fixed noise, checkpoints, metrics.

Examples::

    python examples/dcgan.py --dataset digits --image-size 16 --epochs 20
    python examples/dcgan.py --dataset cifar10 --synthetic --epochs 1   # offline, random images
    python examples/dcgan.py --dataset cifar10 --data-root ~/data --download --sigma 1.0 -c 1.0
    torchrun --nproc_per_node=2 examples/dcgan.py --dataset mnist --data-root ~/data --target-digit 8
"""

import argparse
import os
import sys

import torch
import torch.nn as nn

from common import checkpoints
from common.cli import (add_distributed_args, add_privacy_args, add_synthetic_args, add_unsafe_resume_arg,
                        check_common_args, default_output_dir, make_parser)
from common.distributed import barrier, init_from_args, shutdown, wrap_model
from common.privacy import prepare_training
from common.reporting import MetricsLog, privacy_line, resume_line, run_settings_line
from common.gan import Discriminator, Generator, build_dataset, discriminator_frozen, save_grids
from common.loop import EpochProgress, epsilon_due, set_epoch, to_device


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("DCGAN with a differentially private discriminator")
    parser.add_argument("--dataset", default="digits", choices=["cifar10", "mnist", "folder", "fake", "digits"],
                        help="the private images")
    parser.add_argument("--data-root", default="data", help="dataset location (folder for 'folder')")
    parser.add_argument("--download", action="store_true", help="download cifar10/mnist if missing")
    add_synthetic_args(parser)
    parser.add_argument("--target-digit", type=int, default=None, help="mnist/digits: train on one digit")
    parser.add_argument("--fake-size", type=int, default=1000, help="number of FakeData images")
    parser.add_argument("--image-size", type=int, default=32, help="side of the square images (2^k ≥ 8)")
    parser.add_argument("--nz", type=int, default=100, help="size of the latent vector")
    parser.add_argument("--ngf", type=int, default=64, help="generator width")
    parser.add_argument("--ndf", type=int, default=64, help="discriminator width")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the real images")
    parser.add_argument("--batch-size", type=int, default=64, help="expected real batch per process")
    parser.add_argument("--sample-rate", type=float, default=None, help="Poisson q (None: B·R/N)")
    parser.add_argument("--lr", type=float, default=2e-4, help="Adam learning rate of D and G")
    parser.add_argument("--beta1", type=float, default=0.5, help="Adam β1")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation, sampling, noise")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--outf", default=default_output_dir("dcgan"), metavar="DIR",
                        help="folder for images and checkpoints")
    parser.add_argument("--checkpoint-file", default=None, metavar="PATH", help="None: <outf>/dcgan.pt")
    parser.add_argument("--resume", default="", metavar="PATH", help="continue from this checkpoint")
    add_unsafe_resume_arg(parser)
    parser.add_argument("--metrics-file", default=None, metavar="PATH", help="JSON metrics")
    parser.add_argument("--tensorboard", "--log-dir", dest="tensorboard", default=None, metavar="DIR",
                        help="TensorBoard log directory (needs the tensorboard package)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("-p", "--print-freq", type=int, default=10,
                        help="refresh ε in the progress bar at the first step and every this many steps")
    add_distributed_args(parser)
    add_privacy_args(parser, sigma=1.0, max_grad_norm=1.0)
    parser.set_defaults(n_accumulation_steps=1, workers=0, evaluate=False, batch_size_test=1)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.image_size < 8 or args.image_size & (args.image_size - 1):
        parser.error("--image-size must be a power of two, at least 8")
    args.checkpoint_file = args.checkpoint_file or os.path.join(args.outf, "dcgan.pt")
    return args


def _adam(args, params):
    return torch.optim.Adam(params, lr=args.lr, betas=(args.beta1, 0.999))


def build(args, setup, dataset, channels: int):
    """``(run, generator, optimizer_g, entries)``: D private (run.model), G plain."""
    torch.manual_seed(args.seed)
    netG = Generator(args.nz, args.ngf, channels, args.image_size).to(setup.device)
    netD = Discriminator(args.ndf, channels, args.image_size).to(setup.device)
    netG = wrap_model(netG, setup, private=False)
    netD = wrap_model(netD, setup, private=not args.disable_dp)
    saved = checkpoints.read(args.resume, args.unsafe_resume) if args.resume else {}
    sigma = checkpoints.saved_noise_multiplier(args, saved, lambda text: setup.is_main and print(text))
    run = prepare_training(args, netD, _adam(args, netD.parameters()), dataset, setup,
                           noise_multiplier=sigma)
    optimizer_g = _adam(args, netG.parameters())
    entries = {}
    if args.resume:
        entries = checkpoints.restore(run, args.resume, map_location=setup.device,
                                       unsafe=args.unsafe_resume)
        checkpoints.unwrap(netG).load_state_dict(entries.pop("generator_state_dict"))
        optimizer_g.load_state_dict(entries.pop("generator_optimizer_state_dict"))
    return run, netG, optimizer_g, entries


def fake_rows(run, dataset_size: int, world_size: int) -> int:
    """Fixed number F of fake rows per D step: the expected real batch of one process."""
    q = run.sample_rate if run.private else run.train_loader.batch_size * world_size / dataset_size
    return max(1, round(q * dataset_size / world_size))


def latent_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """Generator of the latent vectors z of one epoch on one rank (resumable, distinct per rank)."""
    return torch.Generator().manual_seed((seed * 100_003 + epoch) * 1_009 + rank)


def train_epoch(args, run, netG, optimizer_g, setup, epoch: int, fakes: int) -> dict:
    """One pass of Poisson batches: private D step, then non-private G step (module doc)."""
    criterion = nn.BCEWithLogitsLoss()
    run.model.train()
    netG.train()
    set_epoch(run.train_loader, epoch)
    latent = latent_generator(args.seed, epoch, setup.rank)
    totals = {"loss_d": 0.0, "loss_g": 0.0, "steps": 0}
    show = setup.is_main and not args.no_progress
    epsilon = run.epsilon()
    with EpochProgress(total=len(run.train_loader), epoch=epoch, enabled=show) as bar:
        for batch in run.train_loader:
            loss_d, loss_g = _train_step(args, run, netG, optimizer_g, setup, batch, fakes, latent, criterion)
            totals["loss_d"] += loss_d
            totals["loss_g"] += loss_g
            totals["steps"] += 1
            if run.private and epsilon_due(totals["steps"], totals["steps"] - 1, args.print_freq):
                epsilon = run.epsilon()
            bar.advance(**_shown(loss_d, loss_g, epsilon if run.private else None))
        epsilon = run.epsilon()
        bar.close(**_shown(loss_d, loss_g, epsilon if run.private else None) if totals["steps"] else {})
    steps = max(totals["steps"], 1)
    return {"epoch": epoch, "loss_d": totals["loss_d"] / steps, "loss_g": totals["loss_g"] / steps,
            "steps": totals["steps"], "epsilon": epsilon}


def _train_step(args, run, netG, optimizer_g, setup, batch, fakes: int, latent, criterion):
    """Private D step on ``[real ; fake]``, then the non-private G step; the two losses."""
    real = to_device(batch[0], setup.device)
    fake = netG(torch.randn(fakes, args.nz, 1, 1, generator=latent).to(setup.device))
    labels = torch.cat([torch.ones(len(real)), torch.zeros(fakes)]).to(setup.device)
    run.optimizer.zero_grad(set_to_none=True)
    loss_d = criterion(run.model(torch.cat([real, fake.detach()])), labels)
    loss_d.backward()
    run.optimizer.step()
    optimizer_g.zero_grad(set_to_none=True)
    with discriminator_frozen(run.model):
        loss_g = criterion(run.model(fake), torch.ones(fakes, device=setup.device))
        loss_g.backward()
    optimizer_g.step()
    return loss_d.item(), loss_g.item()


def _shown(loss_d: float, loss_g: float, epsilon) -> dict:
    return dict(loss_d=f"{loss_d:.3f}", loss_g=f"{loss_g:.3f}",
                **({"eps": f"{epsilon:.3f}"} if epsilon is not None else {}))


def _save(run, args, setup, netG, optimizer_g, entries: dict) -> None:
    if setup.is_main:
        entries = dict(entries, generator_state_dict=checkpoints.unwrap(netG).state_dict(),
                       generator_optimizer_state_dict=optimizer_g.state_dict())
        checkpoints.save(run, args.checkpoint_file, entries)
    barrier(setup)


def _announce(args, setup, run, entries: dict) -> None:
    """The privacy settings, where the outputs go, and where a resumed run continues."""
    if not setup.is_main:
        return
    if run.private:
        print(run_settings_line(run, args.epochs), flush=True)
    print(f"outputs: {args.outf} (checkpoint {args.checkpoint_file})", flush=True)
    if args.resume:
        per_epoch = len(run.train_loader)
        steps = run.accounted_steps() if run.private else entries.get("epoch", 0) * per_epoch
        print(resume_line(args.resume, steps=steps, planned_steps=args.epochs * per_epoch,
                          finished=entries.get("epoch", 0) >= args.epochs,
                          epsilon=run.epsilon() if run.private else None), flush=True)


def train(args, setup, dataset, channels: int) -> str:
    """All epochs; returns why training stopped ("done" or "privacy budget")."""
    from opacus_dp.errors import PrivacyBudgetExceededError

    run, netG, optimizer_g, entries = build(args, setup, dataset, channels)
    log = MetricsLog(args.metrics_file, args.tensorboard, enabled=setup.is_main,
                     settings=vars(args), history=entries.get("metrics"))
    fixed_noise = torch.randn(64, args.nz, 1, 1, generator=torch.Generator().manual_seed(args.seed))
    fakes, stopped = fake_rows(run, len(dataset), setup.world_size), "done"
    _announce(args, setup, run, entries)
    for epoch in range(entries.get("epoch", 0) + 1, args.epochs + 1):
        try:
            record = train_epoch(args, run, netG, optimizer_g, setup, epoch, fakes)
        except PrivacyBudgetExceededError as error:
            if setup.is_main:
                print(f"stopping: {error}", flush=True)
            _save(run, args, setup, netG, optimizer_g, dict(epoch=epoch - 1, metrics=log.epochs))
            stopped = "privacy budget"
            break
        log.add_epoch(record)
        if setup.is_main:
            save_grids(args.outf, dataset, checkpoints.unwrap(netG), fixed_noise.to(setup.device), epoch)
            eps = f", ε = {record['epsilon']:.3f}" if run.private else ""
            print(f"epoch {epoch}: loss D {record['loss_d']:.4f}, loss G {record['loss_g']:.4f}{eps}",
                  flush=True)
        _save(run, args, setup, netG, optimizer_g, dict(epoch=epoch, metrics=log.epochs))
    epsilon = run.epsilon()
    log.finish(epsilon=epsilon, privacy=run.privacy_summary(), world_size=setup.world_size,
               stopped=stopped, fake_rows=fakes, dataset_size=len(dataset))
    if setup.is_main and run.private:
        print(privacy_line(epsilon, args.delta, run.engine.accountant.mechanism()), flush=True)
    return stopped


def main(argv=None) -> int:
    args = parse_args(argv)
    dataset, channels = build_dataset(args)
    setup = init_from_args(args)
    try:
        train(args, setup, dataset, channels)
        return 0
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Private (DP-SGD) full fine-tuning of a causal language model sharded with FSDP2.

``make_private(..., fsdp=...)`` shards the model with ``torch.distributed.fsdp.fully_shard``
(every decoder block, then the root) and points the optimizer at the shards. Each rank
draws its share of every Poisson batch, computes its examples' clipped gradients, and the
clipped sums are reduce-scattered into the shards; each rank noises its own shard. ε is the
same on every rank.

Model: ``--model-name-or-path PATH`` loads a checkpoint with ``AutoModelForCausalLM`` and
``AutoTokenizer``; ``--from-config llama`` (the default without a path) builds a small random
``LlamaForCausalLM`` over a byte-level tokenizer, so the script runs offline.

Data: the Python Language Reference shipped in ``pydoc_data.topics``, cut into blocks of
``--block-size`` tokens; one block is one example, the unit of privacy. Loss: each example's
mean next-token loss, averaged over the batch (``loss_reduction="mean"``).

Only rank 0 prints: the privacy settings, per epoch the training loss, the held-out
perplexity and ε, and at the end ``final: steps=N epsilon=E perplexity=P``.

Examples::

    torchrun --nproc_per_node=2 examples/fsdp_finetune.py                 # CPU (gloo), tiny Llama
    torchrun --nproc_per_node=2 examples/fsdp_finetune.py --epochs 1 --checkpoint-dir ckpt
    torchrun --nproc_per_node=2 examples/fsdp_finetune.py --epochs 2 --checkpoint-dir ckpt --resume
    torchrun --nproc_per_node=8 examples/fsdp_finetune.py --bf16 \\
        --model-name-or-path meta-llama/Llama-3.2-1B --block-size 256 --batch-size 512 \\
        --max-physical-batch-size 8 --epsilon 8 --lr 1e-5 --checkpoint-dir ckpt-llama
"""

import argparse
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

from common.cli import add_fast_noise_arg, make_parser
from common.fsdp_llama import (
    build_model,
    fsdp_options,
    held_out_perplexity,
    join_process_group,
    leave_process_group,
    load_blocks,
    load_tokenizer,
    next_token_logits,
    per_example_mean_loss,
    sum_over_ranks,
)
from common.loop import set_epoch
from common.notices import engine_notices, say_error
from common.privacy import fast_noise_of
from common.reporting import privacy_line, resume_line, settings_line
from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager

CHECKPOINT_MARK = "private_rank0.pt"  # written by save_checkpoint into a sharded checkpoint directory
SECURE_MODE_NOTE = ("note: secure_mode is off: the noise comes from a seeded generator, fine for experiments; "
                    "build the engine with secure_mode=True for a model you release")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and data")
    group.add_argument("--model-name-or-path", default=None, metavar="PATH",
                       help="pretrained causal LM and tokenizer: a local folder or a hub name (from_pretrained)")
    group.add_argument("--from-config", default=None, choices=["llama"],
                       help="random model of this architecture, byte-level tokenizer, offline "
                            "(the default when --model-name-or-path is not given)")
    group.add_argument("--n-layers", type=int, default=2, help="--from-config: decoder blocks")
    group.add_argument("--hidden-size", type=int, default=64, help="--from-config: width")
    group.add_argument("--n-heads", type=int, default=4, help="--from-config: attention heads")
    group.add_argument("--block-size", type=int, default=64, help="tokens per example")
    group.add_argument("--test-fraction", type=float, default=0.1, help="share of the paragraphs held out")
    group.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split")
    group.add_argument("--max-examples", type=int, default=None, metavar="N",
                       help="keep at most N training and N held-out blocks")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--epochs", type=int, default=2, help="passes over the training blocks")
    group.add_argument("--max-steps", type=int, default=None, metavar="N",
                       help="stop after N private steps (the epoch they end in counts as done)")
    group.add_argument("--batch-size", type=int, default=128,
                       help="expected global batch (all ranks together): q = 1/⌈N/B⌉")
    group.add_argument("--max-physical-batch-size", type=int, default=None, metavar="M",
                       help="cut each rank's share of a batch into pieces of at most M blocks "
                            "(BatchMemoryManager: memory only, the step is the same)")
    group.add_argument("--batch-size-test", type=int, default=64, help="held-out blocks per forward pass and rank")
    group.add_argument("--lr", type=float, default=None,
                       help="AdamW learning rate (default: 6e-3 for --from-config, 1e-5 for a checkpoint)")
    group.add_argument("--bf16", action="store_true",
                       help="FSDP2 mixed precision: bfloat16 compute, float32 shards and gradient reduction")
    group.add_argument("--seed", type=int, default=0, help="seed of initialisation, sampling and noise")
    group.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="write a sharded checkpoint (every rank its part) here after each epoch")
    group.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")


def _add_privacy_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("privacy")
    group.add_argument("--grad-sample-mode", default="bk", choices=["bk", "ghost", "hooks"],
                       help="per-sample clipping: bk (book-keeping), ghost (two-pass), hooks (materialised)")
    group.add_argument("--clipping", default="flat", choices=["flat", "per_layer"],
                       help="per_layer: each tensor clipped to C/√n, so the whole gradient stays ≤ C")
    group.add_argument("--sigma", type=float, default=0.8, help="noise multiplier σ")
    group.add_argument("--epsilon", type=float, default=None,
                       help="target ε of --epochs passes: calibrates σ (overrides --sigma)")
    group.add_argument("--delta", type=float, default=1e-5, help="δ of the reported (ε, δ)")
    group.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound C")
    group.add_argument("--accountant", default="prv", choices=["prv", "rdp", "gdp"], help="privacy accountant")
    add_fast_noise_arg(group)


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private full fine-tuning of a causal LM sharded with FSDP2 (launch with torchrun)")
    _add_model_args(parser)
    _add_training_args(parser)
    _add_privacy_args(parser)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.model_name_or_path and args.from_config:
        parser.error("--model-name-or-path and --from-config exclude each other")
    positive = ("n_layers", "hidden_size", "n_heads", "epochs", "batch_size", "batch_size_test",
                "max_steps", "max_physical_batch_size", "max_examples")
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden_size % args.n_heads:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of --n-heads {args.n_heads}")
    if args.block_size < 2:
        parser.error("--block-size must be at least 2")
    if not 0 < args.test_fraction < 1:
        parser.error("--test-fraction must lie in (0, 1)")
    if not 0 < args.delta < 1:
        parser.error("--delta must lie in (0, 1)")
    if not (math.isfinite(args.sigma) and args.sigma >= 0):
        parser.error(f"--sigma must be a finite number ≥ 0, got {args.sigma}")
    for name in ("epsilon", "max_grad_norm", "lr"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir DIR (the checkpoint to continue from)")
    if args.lr is None:
        args.lr = 1e-5 if args.model_name_or_path else 6e-3


# ------------------------------------------------------------------------------ the private run
@dataclass
class Run:
    """What ``make_private`` returned, and the engine that accounts for it."""

    engine: PrivacyEngine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    criterion: object = None  # ghost mode's two-pass criterion

    @property
    def steps(self) -> int:
        return len(self.engine.accountant)


def _max_grad_norm(args, model: nn.Module):
    """C, or with per-layer clipping ``C/√n`` for each of the n trainable tensors."""
    if args.clipping == "flat":
        return args.max_grad_norm
    n = sum(1 for p in model.parameters() if p.requires_grad)
    return [args.max_grad_norm / math.sqrt(n)] * n


def make_private_run(args, ranks, model: nn.Module, train_set) -> Run:
    """Shard ``model`` with FSDP2 and make its training private (σ given or calibrated)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = DataLoader(train_set, batch_size=args.batch_size, generator=torch.Generator().manual_seed(args.seed))
    with engine_notices(ranks.is_main, SECURE_MODE_NOTE):
        engine = PrivacyEngine(accountant=args.accountant)
    common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=_max_grad_norm(args, model),
                  clipping=args.clipping, grad_sample_mode=args.grad_sample_mode, loss_reduction="mean",
                  noise_generator=torch.Generator(ranks.device).manual_seed(args.seed + 1),
                  fast_noise=fast_noise_of(args), fsdp=fsdp_options(ranks, args.bf16))
    if args.grad_sample_mode == "ghost":
        common["criterion"] = nn.CrossEntropyLoss(reduction="mean")
    if args.epsilon is not None:
        made = engine.make_private_with_epsilon(target_epsilon=args.epsilon, target_delta=args.delta,
                                                epochs=args.epochs, **common)
    else:
        made = engine.make_private(noise_multiplier=args.sigma, **common)
    if args.grad_sample_mode == "ghost":
        module, dp_optimizer, criterion, private_loader = made
        return Run(engine, module, dp_optimizer, private_loader, criterion)
    module, dp_optimizer, private_loader = made
    return Run(engine, module, dp_optimizer, private_loader)


def private_loss(run: Run, ids: torch.Tensor):
    """The batch's mean of per-example mean next-token losses (ghost mode: its two-pass loss)."""
    logits, targets = next_token_logits(run.model, ids)
    if run.criterion is None:
        return per_example_mean_loss(logits, targets)
    return run.criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=logits.shape)


def _physical_batches(run: Run, args):
    """The Poisson batches, cut into pieces by ``BatchMemoryManager`` with ``--max-physical-batch-size``."""
    if args.max_physical_batch_size is None:
        return nullcontext(run.loader)
    return BatchMemoryManager(data_loader=run.loader, max_physical_batch_size=args.max_physical_batch_size,
                              optimizer=run.optimizer)


def train_epoch(run: Run, args, ranks, epoch: int) -> float:
    """One pass of Poisson batches (or until ``--max-steps``); the mean training loss.

    Every rank runs every piece, empty ones included: FSDP2's forward and backward passes are
    collectives, and an empty batch still takes its (noise only) step."""
    set_epoch(run.loader, epoch)
    loss_sum, seen = 0.0, 0
    with _physical_batches(run, args) as batches:
        for (ids,) in batches:
            ids = ids.to(ranks.device)
            run.optimizer.zero_grad(set_to_none=True)
            loss = private_loss(run, ids)
            loss.backward()
            run.optimizer.step()
            if len(ids):
                loss_sum, seen = loss_sum + float(loss.detach()) * len(ids), seen + len(ids)
            if args.max_steps is not None and run.steps >= args.max_steps:
                break
    loss_sum, seen = sum_over_ranks(ranks.device, loss_sum, seen)
    return loss_sum / max(seen, 1)


# ------------------------------------------------------------------------------ checkpoints
def save(run: Run, args, epoch: int) -> None:
    """Every rank writes its part of ``--checkpoint-dir`` (collective)."""
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    run.engine.save_checkpoint(path=args.checkpoint_dir, module=run.model, optimizer=run.optimizer,
                               checkpoint_dict={"epoch": epoch, "sigma": run.optimizer.noise_multiplier})


def resume(run: Run, args) -> int:
    """Load ``--checkpoint-dir`` (model and optimizer shards, privacy history, generators);
    return the last epoch it finished."""
    if not os.path.isfile(os.path.join(args.checkpoint_dir, CHECKPOINT_MARK)):
        raise SystemExit(f"--resume: no sharded checkpoint in {args.checkpoint_dir}")
    entries = run.engine.load_checkpoint(path=args.checkpoint_dir, module=run.model, optimizer=run.optimizer)
    if entries.get("sigma") != run.optimizer.noise_multiplier:
        raise SystemExit(f"--resume: the checkpoint was trained with σ = {entries.get('sigma')}, this run "
                         f"with σ = {run.optimizer.noise_multiplier}: give the same --sigma/--epsilon and --epochs")
    return int(entries["epoch"])


# ------------------------------------------------------------------------------ main
def say(ranks, text: str) -> None:
    if ranks.is_main:
        print(text, flush=True)


def train(run: Run, args, ranks, test_set, first_epoch: int):
    """Epochs ``first_epoch..--epochs`` (or until ``--max-steps``); the final held-out perplexity."""
    perplexity = None
    if first_epoch == 1:
        initial = held_out_perplexity(run.model, test_set, args.batch_size_test, ranks)
        say(ranks, f"before training: held-out perplexity {initial:.3f}")
    for epoch in range(first_epoch, args.epochs + 1):
        if args.max_steps is not None and run.steps >= args.max_steps:
            break
        train_loss = train_epoch(run, args, ranks, epoch)
        perplexity = held_out_perplexity(run.model, test_set, args.batch_size_test, ranks)
        epsilon = run.engine.get_epsilon(args.delta)
        say(ranks, f"epoch {epoch}: train loss {train_loss:.4f}, held-out perplexity {perplexity:.3f}, "
                   f"ε = {epsilon:.4f}, steps {run.steps}")
        if args.checkpoint_dir:
            save(run, args, epoch)
    if perplexity is None:  # nothing left to train
        perplexity = held_out_perplexity(run.model, test_set, args.batch_size_test, ranks)
    return perplexity


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args)
    train_set, test_set = load_blocks(args, tokenizer)
    ranks = join_process_group()
    try:
        torch.manual_seed(args.seed)  # the same initial model on every rank
        model = build_model(args, tokenizer, ranks.device)
        n_params = sum(p.numel() for p in model.parameters())
        run = make_private_run(args, ranks, model, train_set)
        say(ranks, f"model: {args.model_name_or_path or 'llama (random, from config)'}, {n_params:,} parameters, "
                   f"FSDP2 over {ranks.world_size} ranks ({ranks.device.type}){', bf16' if args.bf16 else ''}")
        say(ranks, f"data: {len(train_set)} training and {len(test_set)} held-out blocks of {args.block_size} tokens")
        planned = args.epochs * len(run.loader)
        planned = planned if args.max_steps is None else min(planned, args.max_steps)
        if run.loader.sample_rate >= 1:
            say_error(f"warning: --batch-size {args.batch_size} ≥ {len(train_set)} training blocks: sample "
                      "rate q = 1, every private step uses all of them (no privacy amplification by "
                      "sampling); pass a smaller --batch-size for a sampled run", ranks.is_main)
        say(ranks, settings_line(sigma=run.optimizer.noise_multiplier, sample_rate=run.loader.sample_rate,
                                 steps_per_epoch=len(run.loader), delta=args.delta, accountant=args.accountant,
                                 planned_steps=planned, mode=args.grad_sample_mode, clipping=args.clipping,
                                 C=f"{args.max_grad_norm:g}"))
        first_epoch = resume(run, args) + 1 if args.resume else 1
        if args.resume:
            say(ranks, resume_line(args.checkpoint_dir, steps=run.steps, planned_steps=planned,
                                   finished=first_epoch > args.epochs or run.steps >= planned,
                                   epsilon=run.engine.get_epsilon(args.delta)))
        perplexity = train(run, args, ranks, test_set, first_epoch)
        epsilon = run.engine.get_epsilon(args.delta)
        say(ranks, f"final: steps={run.steps} epsilon={epsilon!r} perplexity={perplexity!r}")
        say(ranks, privacy_line(epsilon, args.delta, args.accountant))
        dist.barrier()  # no rank leaves the group while another still talks to it
        return 0
    finally:
        leave_process_group()


if __name__ == "__main__":
    status = main()
    # torch 2.14's FSDP2 under gloo sometimes aborts at interpreter exit ("terminate called without
    # an active exception") after the work is done: leave without the interpreter's teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

"""Command-line flags shared by the examples (names as in the Opacus example scripts).

Batch sizes: ``--batch-size B`` is the expected *physical* batch per process; one private
step (a "logical" Poisson batch) holds ``B × n_accumulation_steps × world_size`` examples in
expectation, i.e. the sample rate is ``q = B · k · R / N`` unless ``--sample-rate`` gives q.

Outputs (checkpoints, images) go by default to ``$XDG_CACHE_HOME/opacus_dp/examples/<example>/``
(``~/.cache/...`` when the variable is unset), never into the directory the script is run from;
the path is printed at the start, and ``--checkpoint-file``/``--outf`` choose another.
"""

import argparse
import logging
import math
import os
from typing import List, Optional, Sequence

import torch


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless X is None, False or "" (an unset option
    or an off switch, whose help says what happens) or the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == "" \
                or "%(default)" in text or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def make_parser(description: str) -> argparse.ArgumentParser:
    """The parser of an example; ``--help`` shows every default (:class:`HelpFormatter`)."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def default_output_dir(example: str) -> str:
    """``$XDG_CACHE_HOME/opacus_dp/examples/<example>`` (``~/.cache`` if unset): outputs of a run
    without ``--checkpoint-file``/``--outf`` stay out of the working directory (module doc)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "opacus_dp", "examples", example)


def default_checkpoint_file(example: str) -> str:
    return os.path.join(default_output_dir(example), f"{example}.pt")


def add_privacy_args(parser: argparse.ArgumentParser, *, sigma: float, max_grad_norm: float,
                     delta: float = 1e-5) -> None:
    group = parser.add_argument_group("privacy")
    group.add_argument("--sigma", type=float, default=sigma, help="noise multiplier σ")
    group.add_argument("-c", "--max-per-sample-grad_norm", "--max-grad-norm", dest="max_grad_norm",
                       type=float, default=max_grad_norm, help="per-sample clipping bound C")
    group.add_argument("--delta", type=float, default=delta, help="δ of the reported (ε, δ)")
    group.add_argument("--target-epsilon", type=float, default=None,
                       help="calibrate σ so that --epochs spend at most this ε (overrides --sigma)")
    group.add_argument("--max-epsilon", type=float, default=None,
                       help="stop cleanly (checkpoint, exit 0) before a step would exceed this ε")
    group.add_argument("--accountant", default=None, choices=["prv", "rdp", "gdp"],
                       help="accountant (modern API, default prv; the classic API uses rdp)")
    group.add_argument("--api", default="modern", choices=["modern", "classic"],
                       help="modern: make_private (Opacus 1.x); classic: PrivacyEngine(model, ...).attach")
    group.add_argument("--clip_per_layer", "--clip-per-layer", dest="clip_per_layer", action="store_true",
                       help="clip each parameter tensor to C/sqrt(number of tensors) (per-layer clipping; "
                            "the whole gradient is still bounded by C)")
    group.add_argument("--grad-sample-mode", "--grad_sample_mode", dest="grad_sample_mode", default="hooks",
                       choices=["hooks", "functorch", "bk", "auto"],
                       help="how per-sample clipped gradients are computed: hooks (materialised), "
                            "functorch (torch.func), bk (book-keeping, norms without materialising), "
                            "auto (picks one); 'ghost' is not offered: its criterion's two-pass "
                            "backward does not fit these loops, and bk gives the same update in one")
    group.add_argument("--disable-dp", action="store_true", help="train without privacy (baseline)")
    group.add_argument("--secure-rng", action="store_true",
                       help="OS-seeded noise and sampling (slower; for final models)")
    add_fast_noise_arg(group)


def add_fast_noise_arg(group) -> None:
    """``--fast-noise off|threads|philox``: ``make_private``'s ``fast_noise`` by name
    (:data:`opacus_dp.engine.fast_noise.FAST_NOISE_NAMES`)."""
    from opacus_dp.engine.fast_noise import FAST_NOISE_NAMES

    group.add_argument("--fast-noise", default="off", choices=tuple(FAST_NOISE_NAMES),
                       help="noise generator: off (torch's, one thread), threads (parallel threads on CPU), "
                            "philox (counter-based, drawn and added in one pass: fastest on CPU); "
                            "a checkpoint resumes with its own")


def add_training_args(parser: argparse.ArgumentParser, *, epochs: int, batch_size: int, lr: float,
                      optim: str = "SGD", momentum: float = 0.0,
                      batch_size_test_flags: Sequence[str] = ("--batch-size-test",)) -> None:
    """Training flags; the aliases are those of Opacus's example scripts (``-j``, ``--wd``,
    ``-p``, ``--n_accumulation_steps``, ``--start-epoch``, ``--lr-schedule``)."""
    group = parser.add_argument_group("training")
    group.add_argument("--epochs", type=int, default=epochs, help="total number of epochs")
    group.add_argument("--start-epoch", type=int, default=None, metavar="N",
                       help="number of the first epoch to run (epochs N..--epochs; useful on restarts); "
                            "None: 1, or the epoch after the one of --resume")
    group.add_argument("--batch-size", type=int, default=batch_size,
                       help="expected physical batch size per process")
    group.add_argument(*batch_size_test_flags, dest="batch_size_test", type=int, default=256,
                       help="batch size of evaluation")
    group.add_argument("--sample-rate", type=float, default=None,
                       help="Poisson sample rate q of a private step (default B·k·R/N, see module doc)")
    group.add_argument("--n-accumulation-steps", "--n_accumulation_steps", "-na", dest="n_accumulation_steps",
                       type=int, default=1,
                       help="physical batches per private step (memory: gradients are accumulated)")
    group.add_argument("--lr", "--learning-rate", type=float, default=lr, help="learning rate")
    group.add_argument("--lr-schedule", default="constant", choices=["constant", "cos"],
                       help="cos: lr · (1 + cos(π·epoch/(epochs+1)))/2 at each epoch (Opacus's schedule)")
    group.add_argument("--momentum", type=float, default=momentum, help="SGD/RMSprop momentum")
    group.add_argument("--weight-decay", "--wd", dest="weight_decay", type=float, default=0.0, help="weight decay")
    group.add_argument("--optim", default=optim, choices=["SGD", "Adam", "RMSprop"], help="optimizer")
    group.add_argument("--seed", type=int, default=0, help="seed of initialisation, sampling, noise")
    group.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    group.add_argument("--data-parallel", action="store_true",
                       help="replicate the model over the visible GPUs with nn.DataParallel")
    group.add_argument("-j", "--workers", type=int, default=0, help="data loading worker processes")
    group.add_argument("-p", "--print-freq", type=int, default=10,
                       help="refresh ε in the progress bar at the first step and every this many steps")
    add_distributed_args(parser)


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Process-group flags of Opacus's examples (``torchrun`` sets the environment itself)."""
    group = parser.add_argument_group("distributed")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1,
                       help="local rank given by a launcher that passes it as a flag (torchrun sets "
                            "LOCAL_RANK, which takes precedence); -1: from the environment")
    group.add_argument("--dist_backend", "--dist-backend", dest="dist_backend", default=None,
                       choices=["gloo", "nccl", "mpi"],
                       help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
    group.add_argument("--debug", type=int, default=0, help="debug level: 1 or more logs at DEBUG level")


def add_unsafe_resume_arg(parser) -> None:
    parser.add_argument("--unsafe-resume", action="store_true",
                        help="read --resume with the full unpickler, which runs any code pickled in "
                             "the file: only for an old checkpoint you wrote yourself")


def add_output_args(parser: argparse.ArgumentParser, *, example: str) -> None:
    group = parser.add_argument_group("outputs")
    group.add_argument("--checkpoint-file", default=default_checkpoint_file(example), metavar="PATH",
                       help="path of the last checkpoint; the best one gets the suffix _best")
    group.add_argument("--resume", default="", metavar="PATH",
                       help="continue from this checkpoint (model, optimizer, privacy history)")
    add_unsafe_resume_arg(group)
    group.add_argument("-e", "--evaluate", action="store_true",
                       help="only evaluate the model (of --resume) on the test set")
    group.add_argument("--metrics-file", default=None, metavar="PATH", help="JSON metrics")
    group.add_argument("--tensorboard", "--log-dir", dest="tensorboard", default=None, metavar="DIR",
                       help="TensorBoard log directory (needs the tensorboard package)")
    group.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_data_args(parser: argparse.ArgumentParser, *, data_root: str, download: bool = True) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data-root", default=data_root, help="where the dataset lives")
    if download:
        group.add_argument("--download", action="store_true",
                           help="download the dataset into --data-root if it is missing")
    add_synthetic_args(group)


def add_synthetic_args(group) -> None:
    group.add_argument("--synthetic", action="store_true",
                       help="train on random data of the real shapes (no files, no download): to try "
                            "the script offline; the accuracy means nothing")
    group.add_argument("--synthetic-size", type=int, default=1024, metavar="N",
                       help="training examples of --synthetic (a quarter as many test examples)")


def check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject inconsistent flags early (argparse error, exit code 2)."""
    for name in ("epochs", "batch_size", "batch_size_test", "n_accumulation_steps", "print_freq",
                 "synthetic_size"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "start_epoch", None) is not None and not 1 <= args.start_epoch <= args.epochs:
        parser.error(f"--start-epoch must lie in 1..--epochs ({args.epochs}), got {args.start_epoch}")
    if getattr(args, "debug", 0) >= 1:
        logging.basicConfig(level=logging.DEBUG)
    if args.sample_rate is not None and not 0 < args.sample_rate <= 1:
        parser.error("--sample-rate must lie in (0, 1]")
    if args.evaluate and not args.resume:
        parser.error("--evaluate needs --resume PATH (the checkpoint to evaluate)")
    if not args.disable_dp and not args.max_grad_norm > 0:
        parser.error("-c/--max-per-sample-grad_norm must be > 0")
    _check_ranges(parser, args)
    try:
        torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)")
    if args.api == "classic" and args.accountant not in (None, "rdp"):
        parser.error("the classic API accounts with RDP: drop --accountant or pass --accountant rdp")
    if args.accountant is None:
        args.accountant = "rdp" if args.api == "classic" else "prv"


_RANGES = {  # flag: (lowest allowed, lowest included?, highest allowed or None)
    "sigma": (0.0, True, None), "delta": (0.0, False, 1.0), "target_epsilon": (0.0, False, None),
    "max_epsilon": (0.0, False, None), "lr": (0.0, False, None), "momentum": (0.0, True, None),
    "weight_decay": (0.0, True, None), "workers": (0, True, None),
}


def _check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Numbers out of range (or NaN, or infinite) are argparse errors naming the flag."""
    for name, (low, inclusive, high) in _RANGES.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        above = value >= low if inclusive else value > low
        below = high is None or value < high
        if not (above and below and math.isfinite(value)):
            bounds = f"{'≥' if inclusive else '>'} {low}" + (f" and < {high}" if high is not None else "")
            parser.error(f"--{name.replace('_', '-')} must be a finite number {bounds}, got {value}")


def sampling_notes(args: argparse.Namespace, num_samples: int, world_size: int) -> List[str]:
    """Lines to print when every private step would use the whole training set (q = 1: no
    amplification by sampling, each step spends the privacy of a full-batch release), and
    whether one process's batch alone is larger than the training set."""
    q = sample_rate_of(args, num_samples, world_size)
    if q < 1:
        return []
    if args.sample_rate is not None:
        return [f"warning: --sample-rate {args.sample_rate:g}: sample rate q = 1, every private step "
                f"uses all {num_samples} training examples (no privacy amplification by sampling)"]
    k, batch = args.n_accumulation_steps, args.batch_size * args.n_accumulation_steps
    parts = f"--batch-size {args.batch_size}" + (f" × --n-accumulation-steps {k}" if k > 1 else "")
    parts += f" × {world_size} processes" if world_size > 1 else ""
    size = (f"{parts} is larger than the training set of {num_samples} examples" if batch > num_samples
            else f"{parts} ≥ {num_samples} training examples")
    return [f"warning: {size}: sample rate q = 1, every private step uses all of them (no privacy "
            "amplification by sampling); pass a smaller --batch-size for a sampled run"]


def sample_rate_of(args: argparse.Namespace, num_samples: int, world_size: int) -> float:
    """q of a private step: ``--sample-rate`` or ``B · k · R / N`` (capped at 1)."""
    if num_samples == 0:
        raise SystemExit("the training set is empty: nothing to train on (check --data-root and "
                         "the options that select the data)")
    if args.sample_rate is not None:
        return float(args.sample_rate)
    logical = args.batch_size * args.n_accumulation_steps * world_size
    return min(1.0, logical / num_samples)


def physical_batch_limit(args: argparse.Namespace) -> Optional[int]:
    """Largest physical batch, or None when each private step is processed in one piece."""
    return args.batch_size if args.n_accumulation_steps > 1 else None

"""Memory and step time of DP-SGD under FSDP2 against non-private FSDP2 and DDP (``--fsdp`` of
``scripts/benchmark_distributed.py``).

For each world size W, a stack of ``--layers`` residual MLP blocks (an ``nn.ModuleList``, width
``--width``) is trained on W processes (CPU ``gloo``; ``--device cuda``: NCCL, one GPU per rank),
every rank on its own random batches, in each mode:

* ``fsdp``           non-private FSDP2: ``fully_shard`` on every block, then on the root;
* ``dp-fsdp-<mode>`` ``make_private(..., fsdp=True, grad_sample_mode=<mode>)`` (bk, hooks, ghost);
  with ``--shard-leaves`` both shard every ``Linear`` itself first, then the blocks and the root
  (by hand, ``make_private(..., fsdp=False)`` on the sharded model);
* ``ddp``            non-private ``DistributedDataParallel`` of the same model;
* ``dp-ddp-bk``      ``make_private(grad_sample_mode="bk")`` around the DDP model.

Each mode runs in fresh processes (unless ``--no-isolate``), so that its memory is measured
alone. Per rank it reports

* ``step_s``: mean time of one step (zero_grad, forward, backward, optimizer step) after the
  warm-up steps, the slowest rank's;
* ``state_bytes``: the bytes of parameters, gradients and optimizer state the rank holds after
  the last step (the local shards of ``DTensor`` parameters): 1/W of the model under FSDP2,
  all of it under DDP;
* ``peak_bytes``: the increase of the process's peak resident memory from before the model is
  built to the end of training (on CUDA: of ``torch.cuda.max_memory_allocated``);
* ``reduce_scatters_per_step`` and ``bytes_per_step`` of the DP reducer (reduce-scatters under
  FSDP2, the all-reduce under DDP), and the number of ``fully_shard`` modules.
"""

import datetime
import gc
import json
import os
import resource
import socket
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.engine.fast_noise import FAST_NOISE_NAMES

FSDP_MODES = ("fsdp", "dp-fsdp-bk", "dp-fsdp-hooks", "dp-fsdp-ghost", "ddp", "dp-ddp-bk")
BASELINE = {"dp-fsdp-bk": "fsdp", "dp-fsdp-hooks": "fsdp", "dp-fsdp-ghost": "fsdp", "dp-ddp-bk": "ddp"}
MIB = 2 ** 20


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))``."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """``layers`` residual blocks of width ``width`` in an ``nn.ModuleList``, then a linear head."""

    def __init__(self, width: int, layers: int, classes: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_residual_mlp(args) -> nn.Module:
    """The benchmark's model, initialised alike on every rank."""
    torch.manual_seed(0)
    return ResidualMLP(args.width, args.layers, args.classes)


def make_inner_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.05)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (its local shard for a ``DTensor``)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    total = 0
    for p in model.parameters():
        total += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if torch.is_tensor(v))
    return total


def private(module: nn.Module, optimizer, args, mode: str, fsdp) -> tuple:
    """``make_private`` in ``mode``; ``(model, optimizer, criterion)``. The loader (one shard per
    process) only sets the batch size: the timed steps bring their own batches (its samples are
    views of one zero row, so that they take no memory)."""
    n = 100 * args.batch_size * dist.get_world_size()
    data = TensorDataset(torch.zeros(1, args.width).expand(n, -1), torch.zeros(1).long().expand(n))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))
    criterion = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine(accountant="rdp").make_private(
            module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode, criterion=criterion,
            fsdp=fsdp, fast_noise=FAST_NOISE_NAMES[getattr(args, "fast_noise", "off")])
    if mode == "ghost":
        return made[0], made[1], made[2]
    return made[0], made[1], criterion


def shard(model: nn.Module, mesh, leaves: bool) -> None:
    """``fully_shard`` on every ``Linear`` (with ``leaves``), every block, then the root."""
    for leaf in (m for m in model.modules() if leaves and isinstance(m, nn.Linear)):
        fully_shard(leaf, mesh=mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_mode(mode: str, args, device: torch.device) -> tuple:
    """``(model, optimizer, criterion)`` of ``mode`` on this rank."""
    model = make_residual_mlp(args).to(device)
    leaves = getattr(args, "shard_leaves", False)
    if mode.startswith("dp-fsdp-"):
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if leaves:
            shard(model, mesh, leaves)
        optimizer = make_inner_optimizer(args.optimizer, model.parameters())
        return private(model, optimizer, args, mode[len("dp-fsdp-"):], fsdp=False if leaves else {"mesh": mesh})
    if mode == "fsdp":
        shard(model, init_device_mesh(device.type, (dist.get_world_size(),)), leaves)
        return model, make_inner_optimizer(args.optimizer, model.parameters()), nn.CrossEntropyLoss()
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_inner_optimizer(args.optimizer, ddp.parameters())
    if mode == "ddp":
        return ddp, optimizer, nn.CrossEntropyLoss()
    return private(ddp, optimizer, args, "bk", fsdp=False)


class PeakMemory:
    """Increase of this process's peak memory from :meth:`start` on: resident memory on CPU
    (the high-water mark reset through ``/proc/self/clear_refs`` where Linux allows it),
    allocated memory on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # peak resident memory := current resident memory
        except OSError:
            pass
        self.base = _status_bytes("VmRSS") or _rusage_peak_bytes()

    def increase(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max(0, (_status_bytes("VmHWM") or _rusage_peak_bytes()) - self.base)


def _status_bytes(field: str) -> int:
    """``field`` of ``/proc/self/status`` in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rusage_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def reducer_counts(optimizer) -> tuple:
    """``(reduce-scatters, bytes)`` the optimizer's DP reducer sent so far (zeros without one)."""
    reducer = getattr(optimizer, "reducer", None)
    return getattr(reducer, "num_reduce_scatters", 0), getattr(reducer, "bytes_reduced", 0)


def timed_steps(setup: tuple, rank: int, args, device: torch.device) -> tuple:
    """Mean step time after ``args.warmup`` steps, and reducer counts per timed step."""
    model, optimizer, criterion = setup
    generator = torch.Generator().manual_seed(1000 + rank)
    elapsed, before = 0.0, (0, 0)
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch_size, args.width, generator=generator).to(device)
        y = torch.randint(0, args.classes, (args.batch_size,), generator=generator).to(device)
        if step == args.warmup:
            before = reducer_counts(optimizer)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            elapsed += time.perf_counter() - start
    after = reducer_counts(optimizer)
    return elapsed / args.steps, [(a - b) / args.steps for a, b in zip(after, before)]


def train_mode(mode: str, rank: int, args, device: torch.device) -> dict:
    """Build and train ``mode`` on this rank; its measures (module doc). A one-step run of a tiny
    model first loads what the mode loads once per process, outside the measured peak."""
    tiny = SimpleNamespace(**{**vars(args), "width": 8, "layers": 1, "warmup": 0, "steps": 1})
    timed_steps(build_mode(mode, tiny, device), rank, tiny, device)
    gc.collect()
    peak = PeakMemory(device)
    peak.start()
    setup = build_mode(mode, args, device)
    step_s, (scatters, sent) = timed_steps(setup, rank, args, device)
    model, optimizer, _ = setup
    return {"step_s": step_s, "state_bytes": rank_state_bytes(model, optimizer),
            "peak_bytes": peak.increase(), "reduce_scatters_per_step": scatters, "bytes_per_step": sent,
            "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules())}


def write_gathered(result, rank: int, world_size: int, out_path: str) -> None:
    """Every rank's ``result`` (JSON-able), written by rank 0 to ``out_path`` as a list by rank."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def fsdp_worker(rank: int, world_size: int, port: int, modes: List[str], args, out_path: str):
    """Train each of ``modes`` in turn on this rank; rank 0 writes every rank's measures. The
    process then leaves without the interpreter's teardown, where torch's gloo and FSDP2 objects
    can abort the process (``std::terminate``) after the work is done."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        write_gathered({mode: train_mode(mode, rank, args, device) for mode in modes}, rank, world_size, out_path)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fsdp_world(world_size: int, args, modes: Sequence[str], isolate: bool = True) -> Dict[str, dict]:
    """Per mode: the slowest rank's step time, the largest peak, each rank's ``state_bytes`` (a
    list) and rank 0's reducer counts. ``isolate``: fresh processes for each mode; otherwise one
    set of processes runs them in turn (quicker to start, but a mode's peak memory then only
    counts what exceeds the memory the earlier modes left mapped)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for group in ([[m] for m in modes] if isolate else [list(modes)]):
            out_path = os.path.join(tmp, "results.json")
            mp.spawn(fsdp_worker, args=(world_size, free_port(), group, args, out_path), nprocs=world_size)
            with open(out_path) as f:
                per_rank = json.load(f)
            for mode in group:
                ranks = [r[mode] for r in per_rank]
                results[mode] = {**ranks[0], "step_s": max(r["step_s"] for r in ranks),
                                 "peak_bytes": max(r["peak_bytes"] for r in ranks),
                                 "state_bytes": [r["state_bytes"] for r in ranks]}
    return results


def time_ratio(results: Dict[str, dict], mode: str) -> float:
    """Step time of ``mode`` over its non-private counterpart's (nan if that did not run)."""
    base = results.get(BASELINE.get(mode, mode))
    return results[mode]["step_s"] / base["step_s"] if base else float("nan")


def print_world(world_size: int, results: Dict[str, dict]) -> None:
    print(f"\nW = {world_size}")
    print(f"{'mode':>14} {'step ms':>9} {'x non-priv':>10} {'state MiB/rank':>14} {'peak MiB':>9} "
          f"{'RS/step':>8} {'fully_shard':>11} {'sent MiB/step':>13}")
    for mode, r in results.items():
        scatters = f"{r['reduce_scatters_per_step']:.0f}" if r["reduce_scatters_per_step"] else "-"
        sent = f"{r['bytes_per_step'] / MIB:.3f}" if r["bytes_per_step"] else "-"
        print(f"{mode:>14} {1e3 * r['step_s']:>9.2f} {time_ratio(results, mode):>10.2f} "
              f"{r['state_bytes'][0] / MIB:>14.3f} {r['peak_bytes'] / MIB:>9.1f} {scatters:>8} "
              f"{r['fsdp_modules']:>11} {sent:>13}")


def print_summary(by_world: Dict[int, Dict[str, dict]]) -> None:
    """Memory at the largest W over the smallest, per mode; private over non-private step time."""
    sizes = sorted(by_world)
    low, high = by_world[sizes[0]], by_world[sizes[-1]]
    print(f"\nSummary: memory at W={sizes[-1]} / W={sizes[0]} (rank 0), step time private / non-private")
    print(f"{'mode':>14} {'state':>7} {'peak':>7} " + " ".join(f"{'time W=' + str(w):>9}" for w in sizes))
    for mode in high:
        state = high[mode]["state_bytes"][0] / low[mode]["state_bytes"][0]
        peak = high[mode]["peak_bytes"] / (low[mode]["peak_bytes"] or float("nan"))
        times = " ".join(f"{time_ratio(by_world[w], mode):>9.2f}" for w in sizes)
        print(f"{mode:>14} {state:>7.3f} {peak:>7.3f} {times}")


def add_fsdp_arguments(parser) -> None:
    """The options of ``--fsdp`` (``--width``, ``--steps``, ``--batch-size`` are shared)."""
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 benchmark: memory per rank and step time (scripts/benchmark_fsdp.py)")
    parser.add_argument("--layers", type=int, default=8, help="--fsdp: residual blocks")
    parser.add_argument("--classes", type=int, default=10, help="--fsdp: outputs of the head")
    parser.add_argument("--warmup", type=int, default=3, help="--fsdp: untimed first steps")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="--fsdp: inner optimizer")
    parser.add_argument("--fast-noise", choices=tuple(FAST_NOISE_NAMES), default="off",
                        help="--fsdp: the noise generator of the private settings (make_private's fast_noise)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="--fsdp: cuda runs NCCL with one GPU per rank")
    parser.add_argument("--modes", nargs="+", choices=FSDP_MODES, default=list(FSDP_MODES),
                        help="--fsdp: modes to run")
    parser.add_argument("--shard-leaves", action="store_true",
                        help="--fsdp: fully_shard every Linear itself too (FSDP2 modes)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="--fsdp: run all modes in one set of processes (quicker; peak memory "
                             "of later modes then undercounted)")


def run_fsdp_benchmark(args, world_sizes: List[int]) -> Dict[int, Dict[str, dict]]:
    """Print the model size, one table per world size and the summary; return the results."""
    params = sum(p.numel() for p in make_residual_mlp(args).parameters())
    print(f"Residual MLP: {args.layers} blocks of width {args.width}, {params} parameters "
          f"({4 * params / MIB:.2f} MiB in float32), {args.optimizer}, per-process batch "
          f"{args.batch_size}, {args.steps} timed steps after {args.warmup}, device {args.device}"
          + (", every Linear sharded itself" if getattr(args, "shard_leaves", False) else ""))
    by_world = {}
    for world_size in world_sizes:
        by_world[world_size] = run_fsdp_world(world_size, args, args.modes, args.isolate)
        print_world(world_size, by_world[world_size])
    print_summary(by_world)
    return by_world

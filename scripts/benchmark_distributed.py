"""Cost of distributed DP-SGD against non-private DDP, on 1, 2 and 4 CPU (gloo) processes.

For each world size W and each mode, every rank trains the same MLP on its own random
batches and reports the mean wall time of one training step (forward, backward, optimizer
step) and the bytes it put into all-reduce collectives per step:

* ``ddp``        non-private ``DistributedDataParallel`` (bytes counted by a comm hook
                 that wraps the standard all-reduce);
* ``dp-ddp``     DP-SGD with ``DistributedDataParallel``: the no-op comm hook stops DDP's
                 all-reduce, the optimizer's ``AllReduceReducer`` sends the clipped sums;
* ``dp-dpddp``   DP-SGD with ``DifferentiallyPrivateDistributedDataParallel``;
* ``dp-2x``      for contrast, DP-SGD on DDP *without* the no-op hook: DDP also
                 all-reduces the unclipped gradients, doubling the traffic;
* ``bk-ddp``, ``bk-dpddp``  ``make_private(grad_sample_mode="bk")`` on a DDP / DPDDP model:
                 the book-keeping mode's clipped sums, one all-reduce per step as well.

Usage: ``python scripts/benchmark_distributed.py [--steps 20] [--batch-size 64]``.

``--fsdp`` runs instead the FSDP2 benchmark of :mod:`benchmark_fsdp` (memory per rank and step
time of DP-SGD under ``fully_shard`` against non-private FSDP2 and DDP; world sizes 1 and 2 by
default): ``python scripts/benchmark_distributed.py --fsdp [--layers 8] [--width 256]``.
"""

import argparse
import datetime
import json
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmark_fsdp import add_fsdp_arguments, free_port, run_fsdp_benchmark, write_gathered

MODES = ("ddp", "dp-ddp", "dp-dpddp", "dp-2x", "bk-ddp", "bk-dpddp")


class ByteCounter:
    """State of :func:`counting_allreduce_hook`: bytes sent into all-reduce so far."""

    def __init__(self):
        self.bytes = 0


def counting_allreduce_hook(state: ByteCounter, bucket):
    """DDP's standard averaging all-reduce, counting the bucket's bytes."""
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 10))


def build_bk(wrapped: nn.Module, batch_size: int):
    """``make_private(grad_sample_mode="bk")`` around a DDP/DPDDP model; the loader (one shard
    per process) only sets the batch size (the timed steps bring their own batches)."""
    from opacus_dp import PrivacyEngine

    width = next(wrapped.parameters()).shape[1]
    data = TensorDataset(torch.zeros(100 * batch_size, width), torch.zeros(100 * batch_size).long())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
            module=wrapped, optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.05),
            data_loader=DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data)),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="bk")
    return model, optimizer, lambda: optimizer.reducer.bytes_reduced


def build(mode: str, width: int, batch_size: int):
    """(model, optimizer, bytes_so_far) for ``mode`` on this rank."""
    from opacus_dp.distributed import (
        AllReduceReducer,
        DifferentiallyPrivateDistributedDataParallel,
        connect_reducer,
        make_reducer,
    )
    from opacus_dp.optim.clipping import FlatClipper
    from opacus_dp.optim.noise import GaussianNoise
    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.optim import DPOptimizer, grad_source_for

    model = make_model(width)
    if mode == "ddp":
        ddp = DistributedDataParallel(model)
        counter = ByteCounter()
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), lambda: counter.bytes
    if mode.endswith("dpddp"):
        wrapped = DifferentiallyPrivateDistributedDataParallel(model)
    else:
        wrapped = DistributedDataParallel(model)
    if mode.startswith("bk-"):
        return build_bk(wrapped, batch_size)
    counter = ByteCounter()
    if mode == "dp-2x":
        wrapped.register_comm_hook(counter, counting_allreduce_hook)
    gsm = GradSampleModule(wrapped)
    reducer = AllReduceReducer() if mode == "dp-2x" else \
        make_reducer(gsm, params=list(gsm.parameters()), names={}, clipper=FlatClipper(1.0), noise=GaussianNoise())
    optimizer = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.05), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=batch_size,
                            grad_source=grad_source_for(gsm), reducer=reducer)
    if mode != "dp-2x":
        connect_reducer(gsm, optimizer, sample_rate=0.01)
    return gsm, optimizer, lambda: optimizer.reducer.bytes_reduced + counter.bytes


def time_modes(rank: int, width: int, batch_size: int, steps: int, warmup: int = 3) -> dict:
    """Mean step time and bytes per step of every mode; modes alternate step by step so
    that load changes on a shared machine affect them alike."""
    setups = {mode: build(mode, width, batch_size) for mode in MODES}
    generator = torch.Generator().manual_seed(1000 + rank)
    criterion = nn.CrossEntropyLoss()
    elapsed = dict.fromkeys(MODES, 0.0)
    bytes_before = dict.fromkeys(MODES, 0)
    for step in range(warmup + steps):
        x = torch.randn(batch_size, width, generator=generator)
        y = torch.randint(0, 10, (batch_size,), generator=generator)
        for mode, (model, optimizer, sent_bytes) in setups.items():
            if step == warmup:
                bytes_before[mode] = sent_bytes()
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            if step >= warmup:
                elapsed[mode] += time.perf_counter() - start
    return {mode: {"step_s": elapsed[mode] / steps,
                   "bytes_per_step": (setups[mode][2]() - bytes_before[mode]) / steps} for mode in MODES}


def worker(rank: int, world_size: int, port: int, args, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        write_gathered(time_modes(rank, args.width, args.batch_size, args.steps), rank, world_size, out_path)
    finally:
        dist.destroy_process_group()


def run_world(world_size: int, args) -> dict:
    """Per-mode step time (max over ranks) and bytes per step (rank 0) for one world size."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(world_size, free_port(), args, out_path), nprocs=world_size)
        with open(out_path) as f:
            per_rank = json.load(f)
    return {m: {"step_s": max(r[m]["step_s"] for r in per_rank),
                "bytes_per_step": per_rank[0][m]["bytes_per_step"]} for m in MODES}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="per-process batch size")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="default: 1 2 4 (with --fsdp: 1 2)")
    add_fsdp_arguments(parser)
    args = parser.parse_args()
    if args.fsdp:
        run_fsdp_benchmark(args, args.world_sizes or [1, 2])
        return
    args.world_sizes = args.world_sizes or [1, 2, 4]
    params = sum(p.numel() for p in make_model(args.width).parameters())
    print(f"MLP with {params} parameters ({4 * params} bytes of float32 gradients), "
          f"per-process batch {args.batch_size}, {args.steps} timed steps")
    print(f"{'W':>2} {'mode':>9} {'step ms':>9} {'bytes/step':>11} {'time/ddp':>9} {'bytes/ddp':>10}")
    for world_size in args.world_sizes:
        results = run_world(world_size, args)
        base = results["ddp"]
        for mode in MODES:
            r = results[mode]
            base_bytes = base["bytes_per_step"] or float("nan")
            byte_ratio = r["bytes_per_step"] / base_bytes
            print(f"{world_size:>2} {mode:>9} {1e3 * r['step_s']:>9.2f} {r['bytes_per_step']:>11.0f} "
                  f"{r['step_s'] / base['step_s']:>9.2f} {byte_ratio:>10.2f}")


if __name__ == "__main__":
    main()

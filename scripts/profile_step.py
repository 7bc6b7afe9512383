"""Where the time of a private step goes, against the non-private step of the same setting.

One process (``gloo``, W = 1) trains the residual MLP of :mod:`benchmark_fsdp` (``--layers`` blocks
of width ``--width``, Adam) in each setting: non-private DDP and FSDP2, and ``make_private`` on the
DDP model and on the model sharded by ``fsdp=True`` (``--modes``, e.g. ``dp-ddp-bk dp-fsdp-bk
dp-fsdp-hooks``). For the private ones the optimizer's phases are timed by wrapping its methods on
the instance (nothing in the package is changed):

* ``forward`` / ``backward``: the model's forward and ``loss.backward()`` (``bk`` forms its per-sample
  norms in the backward pass; ``hooks`` its per-sample gradients);
* ``clip``: gathering the norms, the clip factors and the clipped sums (``clip_and_accumulate``);
* ``reduce``: the reducer's collective (all-reduce / reduce-scatter), its noise excluded;
* ``noise``: drawing the noise and adding it (``add_noise``);
* ``scale``: the mean's division and setting ``p.grad``; ``inner``: the wrapped optimizer's update;
* ``other``: the rest of ``step()`` (checks, agreement, accountant).

Each row is the median over ``--steps`` steps after ``--warmup``. glibc's heap is settled before
the first setting (:mod:`opacus_dp.maths.heap_threshold`, what building a private optimizer does),
so that the non-private settings run in the allocator state the private ones have.

    python scripts/profile_step.py --width 1024 --layers 8 --batch-size 32 --steps 10
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_fsdp import build_mode, free_port  # noqa: E402
from opacus_dp.maths.heap_threshold import settle_heap  # noqa: E402

PHASES = ("forward", "backward", "clip", "reduce", "noise", "scale", "inner", "other")


def _wrap(owner, name: str, times: dict, key: str) -> None:
    """Time every call of ``owner.name`` into ``times[key]`` (an instance attribute shadows it)."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            times[key] += time.perf_counter() - start
    setattr(owner, name, timed)


def instrument(optimizer, times: dict) -> bool:
    """Wrap the phases of a DPOptimizer (False for a plain optimizer: only ``inner`` is timed)."""
    if not hasattr(optimizer, "clip_and_accumulate"):
        _wrap(optimizer, "step", times, "inner")
        return False
    for name, key in (("clip_and_accumulate", "clip"), ("add_noise", "noise"), ("scale_grad", "scale"),
                      ("_set_grads", "scale"), ("_inner_step", "inner")):
        _wrap(optimizer, name, times, key)
    _wrap(optimizer.reducer, "reduce", times, "reduce")
    _wrap(optimizer, "step", times, "step")
    return True


def step_phases(model, optimizer, criterion, x, y, times: dict, private: bool, clock=time.perf_counter) -> dict:
    """Milliseconds of each phase of one step (``times``: what :func:`instrument` fills), and their total."""
    times.clear()
    optimizer.zero_grad()
    start = clock()
    loss = criterion(model(x), y)
    times["forward"] = clock() - start
    start = clock()
    loss.backward()
    times["backward"] = clock() - start
    optimizer.step()
    if private:
        times["reduce"] -= times["noise"]
        inside = sum(times[k] for k in ("clip", "reduce", "noise", "scale", "inner"))
        times["other"] = times.pop("step") - inside
    row = {key: 1000 * times.get(key, 0.0) for key in PHASES}
    row["total"] = sum(row.values())
    return row


def profile_mode(mode: str, args) -> dict:
    """Median milliseconds of each phase of one step of ``mode`` (module doc)."""
    model, optimizer, criterion = build_mode(mode, args, torch.device("cpu"))
    times = defaultdict(float)
    private = instrument(optimizer, times)
    generator = torch.Generator().manual_seed(1000)
    rows = defaultdict(list)
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch_size, args.width, generator=generator)
        y = torch.randint(0, args.classes, (args.batch_size,), generator=generator)
        row = step_phases(model, optimizer, criterion, x, y, times, private)
        if step >= args.warmup:
            for key, value in row.items():
                rows[key].append(value)
    return {key: statistics.median(values) for key, values in rows.items()}


def table(results: dict, baseline: dict) -> str:
    """Markdown: every phase in ms, and each private setting's total over its baseline's."""
    head = "| setting | " + " | ".join(PHASES) + " | step | × non-private |"
    lines = [head, "|" + "---|" * (len(PHASES) + 3)]
    for mode, row in results.items():
        base = results.get(baseline.get(mode, ""), {}).get("total")
        ratio = f"{row['total'] / base:.2f}" if base else "–"
        lines.append(f"| {mode} | " + " | ".join(f"{row[k]:.1f}" for k in PHASES) + f" | {row['total']:.1f} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fast-noise", choices=("off", "threads", "philox"), default="off",
                        help="the noise generator of the private settings (make_private's fast_noise)")
    parser.add_argument("--modes", nargs="+", default=["ddp", "dp-ddp-bk", "fsdp", "dp-fsdp-bk", "dp-fsdp-hooks"])
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settle_heap()  # the baselines in the private settings' allocator state (module doc)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # a port no other process holds
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        results = {mode: profile_mode(mode, SimpleNamespace(**vars(args))) for mode in args.modes}
    finally:
        dist.destroy_process_group()
    baseline = {m: ("fsdp" if "fsdp" in m else "ddp") for m in args.modes if m.startswith("dp-")}
    params = args.layers * 2 * (args.width * args.width + args.width) + args.width * args.classes + args.classes
    out = (f"W = 1 (gloo), residual MLP {args.layers}×{args.width} ({params / 1e6:.1f} M parameters), "
           f"{args.optimizer}, B = {args.batch_size}, {args.threads} thread(s), noise {args.fast_noise}; median ms over {args.steps} steps\n\n"
           + table(results, baseline))
    print(out)
    return out


if __name__ == "__main__":
    main()

"""Step time and peak memory of DP-SGD: opacus_dp's modes against non-private and Opacus 1.6.

For each model of :mod:`benchmark_models` (convnet, resnet, sequence, transformer, lstm, llama)
one process builds every variant side by side, each on its own copy of the model (same initial
weights, same fixed batch; ``--batch-size B``: its first B samples; ``--device cuda``: on the GPU):

* ``non-private``: plain ``torch.optim.SGD``;
* ``hooks``, ``ghost``, ``bk`` (and ``functorch`` with ``--modes``): ``opacus_dp``'s
  ``PrivacyEngine.make_private(grad_sample_mode=...)``; ``auto`` is reported as the mode it picks;
  a mode with the suffix ``-per-layer`` (e.g. ``bk-per-layer``) clips per layer, each of the
  ``n`` tensors to ``C/√n`` (the same sensitivity ``C``);
* ``opacus:hooks``, ``opacus:ghost``: Opacus 1.6's ``PrivacyEngine.make_private`` (ghost with
  its wrapped criterion), when ``opacus`` is installed; a variant that cannot run the model is
  reported as ``n/a`` with its error.

One step = ``zero_grad``, forward, the model's loss (cross-entropy; next-token for ``llama``),
backward, private ``step`` (σ = 1, C = 1). ``--precision`` runs every variant, non-private
included, in that precision: ``fp32``, ``bf16`` (forward and loss under bfloat16 autocast) or
``fp16`` (float16 autocast and a ``torch.amp.GradScaler``; in ``ghost`` the scaler scales the
plain loss tensor, one book-keeping pass, and per-layer ``bk``/``ghost`` are refused:
docs/precision.md).
**Time**: after ``--warmup`` untimed rounds, ``--repeats`` rounds in which every variant runs one
step, the order rotating each round (interleaved, so load drifts hit all variants alike); the
median per variant is reported (wall clock, or process CPU time with ``--timer cpu``, steadier on
a shared machine with ``--threads 1``; on CUDA the wall clock after ``torch.cuda.synchronize()``),
and ``paired x``: the median over rounds of the variant's time divided by the non-private time of
the same round (slow phases of a shared machine hit both terms of a round's ratio alike); likewise
``paired`` next to ``speedup/Op.hk``: the median over rounds of Opacus hooks' time divided by the
variant's. ``faults``: the median of the timed steps' minor page faults (``getrusage``): pages the
step touched for the first time, as after the C library returned freed memory to the system; on a
CPU a variant's time includes them.
**Memory**: each (model, variant) runs in a fresh subprocess (``--probe``): after the model,
optimizer and batch are built, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``)
and the current RSS noted; after ``--memory-steps`` steps the peak (``VmHWM``) minus that RSS
is the *peak increase*: what training adds on top of model and data (activations, gradients,
per-sample state, optimizer state). ``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc return freed
tensors to the OS at once, so RSS follows live memory (and ``THP_MEM_ALLOC_ENABLE`` is unset
there: huge pages would round resident sizes up). On CUDA: ``torch.cuda.max_memory_allocated``
over the steps minus the memory allocated before them. **Tensor peak**: the same on CPU, from the
allocator's own count (the profiler's memory events over as many further steps): the tensors
alone, without what the C library keeps of freed memory or of small objects.
**Allocator**: the timed process runs with the environment it is given, reported in the
table's header and the JSON: e.g. ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator on
2 MiB transparent huge pages, fewer page faults for large tensors) applies to every variant alike.

``--compile BACKEND`` also times non-private and each of our modes compiled
(``model.compile(backend=BACKEND)``, the private model after ``make_private``) in the same rounds,
and prints each compiled variant's time divided by its eager time and by compiled non-private's,
with the graphs and graph breaks Dynamo counts in two of its steps on fresh caches after the timed
rounds (:mod:`compile_stats`; also in the JSON, ``raw_timing[variant]["graphs"]``).

``--channels-last`` lays the image models (convnet, resnet) and their batch out
``torch.channels_last``, every variant alike (the layout oneDNN's convolutions run fastest in on
CPU, and the one ``torch.compile`` gives them).

``--ddp`` wraps every model (non-private included) in ``DistributedDataParallel`` in a process
group of the benchmark's process alone (:mod:`ddp_single_process`), the private ones before
``make_private``, as a DDP script on one rank: with ``--compile``, compiled DDP.

``--fast-noise off|threads|philox`` draws our private variants' noise with that generator
(``make_private``'s ``fast_noise``; default off: torch's, as Opacus); Opacus's variants keep theirs.

Usage::

    python scripts/benchmark.py [--models convnet,sequence] [--repeats 10] [--json out.json]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List

try:
    import resource  # POSIX: the page faults of a step
except ImportError:
    resource = None

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_models import WORKLOADS  # noqa: E402
from benchmark_report import THEIRS, print_table, summarise  # noqa: E402
from memory_probe import allocated_peak_mib, status_kb  # noqa: E402
from compile_stats import COMPILED, add_compile_ratios, allow_recompiles, counting, print_compile_ratios  # noqa: E402
from ddp_single_process import ddp_kwargs  # noqa: E402
from opacus_dp.engine.fast_noise import FAST_NOISE_NAMES  # noqa: E402
from opacus_dp.maths.cpu_products import cpu_products  # noqa: E402

SIGMA, CLIP, LR = 1.0, 1.0, 0.01
OURS = ("hooks", "ghost", "bk")
PER_LAYER = "-per-layer"  # suffix of a mode run with per-layer clipping, e.g. "bk-per-layer"
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- variants
def _private_step(model, optimizer, criterion, x, y, precision: str = "fp32") -> Callable[[], None]:
    dtype, device = PRECISIONS[precision], x.device.type
    scaler = torch.amp.GradScaler(device) if dtype is torch.float16 else None

    def step():
        optimizer.zero_grad()
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = criterion(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
            return
        scaler.scale(getattr(loss, "value", loss)).backward()  # ghost: its plain loss tensor
        scaler.step(optimizer)
        scaler.update()

    return step


def _ours(model, optimizer, loader, mode, criterion, fast_noise=False):
    import opacus_dp

    engine = opacus_dp.PrivacyEngine(accountant="rdp")
    clipping, bound = "flat", CLIP
    if mode.endswith(PER_LAYER):  # same total sensitivity C: C / sqrt(n) per tensor
        mode, clipping = mode[: -len(PER_LAYER)], "per_layer"
        count = sum(1 for p in model.parameters() if p.requires_grad)
        bound = [CLIP / count ** 0.5] * count
    result = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                 noise_multiplier=SIGMA, max_grad_norm=bound, clipping=clipping,
                                 poisson_sampling=False, grad_sample_mode=mode, criterion=criterion,
                                 fast_noise=fast_noise)
    return result[0], result[1], result[2] if len(result) == 4 else criterion


def _theirs(model, optimizer, loader, mode, criterion):
    import opacus

    engine = opacus.PrivacyEngine(accountant="rdp")
    if mode == "ghost":
        return engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                   noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
                                   grad_sample_mode="ghost", criterion=criterion)[:3]
    model, optimizer, _ = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                              noise_multiplier=SIGMA, max_grad_norm=CLIP,
                                              poisson_sampling=False, grad_sample_mode=mode)
    return model, optimizer, criterion


def build_step(workload, variant: str, x, y, precision: str = "fp32", wrap=None,
               fast_noise=False, channels_last: bool = False) -> Callable[[], None]:
    """One training step of ``variant`` on a fresh copy of ``workload``'s model, on ``x``'s device.
    ``<name>@<backend>``: the step of ``name`` (one of ours, or non-private) with the model it
    trains compiled in place (``model.compile(backend=...)``; the private model after
    ``make_private``; docs/compile.md); ``wrap``: applied to the model first (``--ddp``);
    ``fast_noise``: ``make_private``'s setting for our variants; ``channels_last``: an image
    model's parameters laid out ``torch.channels_last`` (``--channels-last``)."""
    name, _, backend = variant.partition(COMPILED)
    theirs = name.startswith("opacus:")
    if theirs:
        import opacus.layers as layers
    else:
        import opacus_dp.layers as layers
    torch.manual_seed(0)
    model = workload.build(layers).to(x.device)
    if channels_last and x.dim() == 4:
        model = model.to(memory_format=torch.channels_last)
    model = wrap(model) if wrap is not None else model
    optimizer, criterion = torch.optim.SGD(model.parameters(), lr=LR), workload.criterion()
    if name != "non-private":
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mode = name.split(":")[-1]
            model, optimizer, criterion = (_theirs(model, optimizer, loader, mode, criterion) if theirs
                                           else _ours(model, optimizer, loader, mode, criterion, fast_noise))
    if backend:
        model.compile(backend=backend)
    return _private_step(model, optimizer, criterion, x, y, precision)


def auto_choice(workload) -> str:
    import opacus_dp.layers as layers
    from opacus_dp.grad_sample.mode_selection import choose_mode

    try:
        return choose_mode(workload.build(layers))
    except ImportError as e:  # a model of a library not installed (its variants report it too)
        return f"n/a ({e})"


# ----------------------------------------------------------------------------- timing
def _precision(args) -> dict:
    """``build_step``'s keywords for ``--precision`` (none for fp32, the default), ``--ddp``,
    ``--channels-last`` and ``--fast-noise`` (none for off, the default)."""
    precision = getattr(args, "precision", "fp32")
    layout = {"channels_last": True} if getattr(args, "channels_last", False) else {}
    noise = getattr(args, "fast_noise", "off")
    fast_noise = {} if noise == "off" else {"fast_noise": FAST_NOISE_NAMES[noise]}
    return {**({} if precision == "fp32" else {"precision": precision}), **ddp_kwargs(args), **layout, **fast_noise}


def _timer(kind: str) -> Callable[[], float]:
    if kind == "cuda":  # the wall clock once the queued kernels have run
        return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]
    return time.process_time if kind == "cpu" else time.perf_counter


def _batch(workload, args):
    """The workload's fixed batch (seed 1): its first ``--batch-size`` samples, on ``--device``;
    images laid out ``torch.channels_last`` with ``--channels-last``."""
    torch.manual_seed(1)
    x, y = workload.batch()
    size, device = getattr(args, "batch_size", None), getattr(args, "device", "cpu")
    if size:
        x, y = x[:size], y[:size]
    x, y = (x, y) if device == "cpu" else (x.to(device), y.to(device))
    if getattr(args, "channels_last", False) and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def time_variants(workload, variants: List[str], args) -> Dict[str, dict]:
    """Median step time of every variant (interleaved rounds, rotating order); a compiled
    variant's ``graphs``: what Dynamo compiles in two steps of it on fresh caches, after the timed
    rounds (:mod:`compile_stats`; variants of one model may share compiled code in the rounds)."""
    x, y = _batch(workload, args)
    steps, errors = {}, {}
    for variant in variants:
        try:
            steps[variant] = build_step(workload, variant, x, y, **_precision(args))
            for _ in range(2 if COMPILED in variant else 1):  # a compiled step learns its calls first
                steps[variant]()
        except Exception as e:  # a library that cannot run this model: reported, not fatal
            errors[variant] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            steps.pop(variant, None)
    clock, names = _timer(args.timer), list(steps)
    samples: Dict[str, List[float]] = {v: [] for v in names}
    faults: Dict[str, List[int]] = {v: [] for v in names}
    for round_index in range(args.warmup + args.repeats):
        shift = round_index % max(len(names), 1)
        for variant in names[shift:] + names[:shift]:
            faulted, start = minor_faults(), clock()
            steps[variant]()
            if round_index >= args.warmup:
                samples[variant].append(clock() - start)
                faults[variant].append(minor_faults() - faulted)
    result = {v: {"ms": 1000 * statistics.median(s), "min_ms": 1000 * min(s),
                  "samples_ms": [1000 * t for t in s], "faults": statistics.median(faults[v])}
              for v, s in samples.items()}
    result.update({v: {"error": e} for v, e in errors.items()})
    for v in (v for v in names if COMPILED in v):  # a recompilation shows in the second step
        torch._dynamo.reset()
        with counting() as result[v]["graphs"]:
            steps[v]()
            steps[v]()
    add_paired_ratios(result)
    return result


def minor_faults() -> int:
    """The process's minor page faults so far (``getrusage``; 0 where it is not available): a step's
    difference is how many pages it touched for the first time, each a trip into the kernel."""
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def add_paired_ratios(timing: Dict[str, dict]) -> None:
    """Per-round ratios (load drifts cancel within a round), their median over the rounds:
    ``paired_x_non_private`` = time / non-private time, ``paired_speedup_vs_opacus_hooks`` =
    Opacus hooks time / time."""
    def samples(variant):
        return timing.get(variant, {}).get("samples_ms")

    base, opacus_hooks = samples("non-private"), samples("opacus:hooks")
    for v, r in timing.items():
        s = r.get("samples_ms")
        if s and base:
            r["paired_x_non_private"] = statistics.median(a / b for a, b in zip(s, base))
        if s and opacus_hooks:
            r["paired_speedup_vs_opacus_hooks"] = statistics.median(h / a for a, h in zip(s, opacus_hooks))


# ----------------------------------------------------------------------------- memory
def probe_memory(model_name: str, variant: str, args) -> dict:
    """Run in a fresh process: peak increase of ``--memory-steps`` training steps (MiB): of the
    RSS, or on CUDA of the allocated memory (``peak_increase_mib``); and of the tensors allocated
    (``tensor_peak_mib``: on CPU over as many further steps, :func:`allocated_peak_mib`)."""
    workload = WORKLOADS[model_name]
    x, y = _batch(workload, args)
    step, steps = build_step(workload, variant, x, y, **_precision(args)), args.memory_steps

    def run():
        for _ in range(steps):
            step()

    if x.is_cuda:  # the allocator's counters, kept on the host as kernels are queued
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        run()
        peak = (torch.cuda.max_memory_allocated() - baseline) / 2 ** 20
        return {"peak_increase_mib": peak, "tensor_peak_mib": peak}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = status_kb("VmRSS")
    run()
    rss = (status_kb("VmHWM") - baseline) / 1024
    return {"peak_increase_mib": rss, "tensor_peak_mib": allocated_peak_mib(run)}


def measure_memory(model_name: str, variant: str, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # 2 MiB pages would round the resident sizes up
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", model_name, variant,
           "--memory-steps", str(args.memory_steps), "--threads", str(args.threads),
           "--precision", getattr(args, "precision", "fp32"), "--device", getattr(args, "device", "cpu")]
    if getattr(args, "batch_size", None):
        cmd += ["--batch-size", str(args.batch_size)]
    cmd += ["--ddp"] if getattr(args, "ddp", False) else []
    cmd += ["--channels-last"] if getattr(args, "channels_last", False) else []
    cmd += ["--fast-noise", args.fast_noise] if getattr(args, "fast_noise", "off") != "off" else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


ALLOCATOR_SETTINGS = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "allocator": {k: os.environ[k] for k in ALLOCATOR_SETTINGS if k in os.environ},
            "cpu_products": cpu_products()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(WORKLOADS), help=f"some of {','.join(WORKLOADS)}")
    parser.add_argument("--modes", default=",".join(OURS),
                        help="opacus_dp modes (hooks,functorch,ghost,bk; suffix -per-layer for "
                             "per-layer clipping, e.g. bk-per-layer)")
    parser.add_argument("--no-opacus", action="store_true", help="skip the Opacus 1.6 variants")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--timer", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                        help="every variant (non-private too) in this precision: bf16/fp16 autocast, "
                             "fp16 with a torch.amp.GradScaler")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="also time non-private and our modes compiled (model.compile(backend=BACKEND), "
                             "e.g. inductor): rows 'x eager' and 'x compiled non-priv'")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="run models and batches there (cuda: the timer is the synchronised wall clock)")
    parser.add_argument("--batch-size", type=int, help="only the first B samples of each model's batch")
    parser.add_argument("--channels-last", action="store_true",
                        help="the image models (convnet, resnet) and their batch in torch.channels_last, "
                             "every variant alike")
    parser.add_argument("--ddp", action="store_true", help="every model (non-private too) in DistributedDataParallel, "
                        "in a process group of this process alone (scripts/ddp_single_process.py)")
    parser.add_argument("--fast-noise", choices=tuple(FAST_NOISE_NAMES), default="off",
                        help="the noise generator of our private variants (make_private's fast_noise: "
                             "off = torch's, threads, philox)")
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--probe", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if set(args.models.split(",")) - set(WORKLOADS):
        raise SystemExit(f"--models: choose among {','.join(WORKLOADS)}, got {args.models}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="GradScaler is going to stop", category=FutureWarning)
    if args.probe:
        print(json.dumps(probe_memory(*args.probe, args)))
        return
    if args.device == "cuda":
        args.timer = "cuda"
    variants = ["non-private"] + [m for m in args.modes.split(",") if m]
    if not args.no_opacus:
        variants += list(THEIRS)
    if args.compile:  # compiled copies of non-private and of our modes, timed in the same rounds
        variants += [f"{v}{COMPILED}{args.compile}" for v in variants if not v.startswith("opacus:")]
        allow_recompiles()
    report = {"machine": machine(), "settings": vars(args), "models": {}}
    report["machine"]["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for model_name in args.models.split(","):
        workload = WORKLOADS[model_name]
        if args.compile:  # the previous model's compiled frames are not needed any more
            torch._dynamo.reset()
        timing = time_variants(workload, variants, args)
        add_compile_ratios(timing)
        memory = {} if args.no_memory else {v: measure_memory(model_name, v, args) for v in timing}
        report["models"][model_name] = {"description": workload.description, "auto": auto_choice(workload),
                                        "variants": summarise(model_name, timing, memory),
                                        "raw_timing": timing, "memory": memory}
        print(f"done: {model_name}", file=sys.stderr)
    report["machine"]["load_average_after"] = os.getloadavg()
    print(f"allocator settings of the timed process: {report['machine']['allocator'] or 'defaults'}; "
          f"precision: {args.precision}; clipped sums' CPU products: {report['machine']['cpu_products']}"
          + ("; images channels-last" if args.channels_last else "")
          + (f"; noise: {args.fast_noise}" if args.fast_noise != "off" else ""))
    print_table(report)
    if args.compile:
        print_compile_ratios(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

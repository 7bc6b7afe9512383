"""Step time and peak memory of DP-SGD: opacus_dp's modes against non-private and Opacus 1.6.

For each model of :mod:`benchmark_models` (convnet, resnet, sequence, transformer, lstm) one
process builds every variant side by side, each on its own copy of the model (same initial
weights, same fixed batch):

* ``non-private``: plain ``torch.optim.SGD``;
* ``hooks``, ``ghost``, ``bk`` (and ``functorch`` with ``--modes``): ``opacus_dp``'s
  ``PrivacyEngine.make_private(grad_sample_mode=...)``; ``auto`` is reported as the mode it picks;
  a mode with the suffix ``-per-layer`` (e.g. ``bk-per-layer``) clips per layer, each of the
  ``n`` tensors to ``C/√n`` (the same sensitivity ``C``);
* ``opacus:hooks``, ``opacus:ghost``: Opacus 1.6's ``PrivacyEngine.make_private`` (ghost with
  its wrapped criterion), when ``opacus`` is installed.

One step = ``zero_grad``, forward, cross-entropy loss, backward, private ``step`` (σ = 1,
C = 1). ``--precision`` runs every variant, non-private included, in that precision: ``fp32``,
``bf16`` (forward and loss under bfloat16 autocast) or ``fp16`` (float16 autocast and a
``torch.amp.GradScaler``; in ``ghost`` the scaler scales the plain loss tensor, one
book-keeping pass, and per-layer ``bk``/``ghost`` are refused: docs/precision.md).
**Time**: after ``--warmup`` untimed rounds, ``--repeats`` rounds in which every
variant runs one step, the order rotating each round (interleaved, so load drifts hit all
variants alike); the median per variant is reported (wall clock, or process CPU time with
``--timer cpu``, steadier on a shared machine with ``--threads 1``), and ``paired x``: the median
over rounds of the variant's time divided by the non-private time of the same round (slow
phases of a shared machine hit both terms of a round's ratio alike); likewise ``paired`` next to
``speedup/Op.hk``: the median over rounds of Opacus hooks' time divided by the variant's.
**Memory**: each (model, variant) runs in a fresh subprocess (``--probe``): after the model,
optimizer and batch are built, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``)
and the current RSS noted; after ``--memory-steps`` steps the peak (``VmHWM``) minus that RSS
is the *peak increase*: what training adds on top of model and data (activations, gradients,
per-sample state, optimizer state). ``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc return freed
tensors to the OS at once, so RSS follows live memory (and ``THP_MEM_ALLOC_ENABLE`` is unset
there: huge pages would round resident sizes up).
**Allocator**: the timed process runs with the environment it is given, reported in the
table's header and the JSON: e.g. ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator on
2 MiB transparent huge pages, fewer page faults for large tensors) applies to every variant alike.

``--compile BACKEND`` also times non-private and each of our modes compiled
(``model.compile(backend=BACKEND)``, the private model after ``make_private``) in the same rounds,
and prints each compiled variant's time divided by its eager time and by compiled non-private's.

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

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_models import WORKLOADS  # noqa: E402

SIGMA, CLIP, LR = 1.0, 1.0, 0.01
OURS = ("hooks", "ghost", "bk")
PER_LAYER = "-per-layer"  # suffix of a mode run with per-layer clipping, e.g. "bk-per-layer"
THEIRS = ("opacus:hooks", "opacus:ghost")
COMPILED = "@"  # "bk@inductor": variant "bk" with its model compiled by that backend (--compile)
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


def _ours(model, optimizer, loader, mode):
    import opacus_dp

    engine = opacus_dp.PrivacyEngine(accountant="rdp")
    clipping, bound = "flat", CLIP
    if mode.endswith(PER_LAYER):  # same total sensitivity C: C / sqrt(n) per tensor
        mode, clipping = mode[: -len(PER_LAYER)], "per_layer"
        count = sum(1 for p in model.parameters() if p.requires_grad)
        bound = [CLIP / count ** 0.5] * count
    result = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                 noise_multiplier=SIGMA, max_grad_norm=bound, clipping=clipping,
                                 poisson_sampling=False, grad_sample_mode=mode)
    return result[0], result[1], result[2] if len(result) == 4 else nn.CrossEntropyLoss()


def _theirs(model, optimizer, loader, mode):
    import opacus

    engine = opacus.PrivacyEngine(accountant="rdp")
    if mode == "ghost":
        return engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                   noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
                                   grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss())[:3]
    model, optimizer, _ = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                              noise_multiplier=SIGMA, max_grad_norm=CLIP,
                                              poisson_sampling=False, grad_sample_mode=mode)
    return model, optimizer, nn.CrossEntropyLoss()


def build_step(workload, variant: str, x, y, precision: str = "fp32") -> Callable[[], None]:
    """One training step of ``variant`` on a fresh copy of ``workload``'s model."""
    if COMPILED in variant:
        return compiled_step(workload, variant, x, y, precision)
    theirs = variant.startswith("opacus:")
    if theirs:
        import opacus.layers as layers
    else:
        import opacus_dp.layers as layers
    torch.manual_seed(0)
    model = workload.build(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if variant == "non-private":
        return _private_step(model, optimizer, nn.CrossEntropyLoss(), x, y, precision)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make = _theirs if theirs else _ours
        model, optimizer, criterion = make(model, optimizer, loader, variant.split(":")[-1])
    return _private_step(model, optimizer, criterion, x, y, precision)


def compiled_step(workload, variant: str, x, y, precision: str = "fp32") -> Callable[[], None]:
    """``<name>@<backend>``: the step of ``name`` (one of ours, or non-private) with the model it
    trains compiled in place (``model.compile(backend=...)``; the private model after
    ``make_private``; docs/compile.md)."""
    import opacus_dp.layers as layers

    name, backend = variant.split(COMPILED)
    torch.manual_seed(0)
    model = workload.build(layers)
    optimizer, criterion = torch.optim.SGD(model.parameters(), lr=LR), nn.CrossEntropyLoss()
    if name != "non-private":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
            model, optimizer, criterion = _ours(model, optimizer, loader, name)
    model.compile(backend=backend)
    return _private_step(model, optimizer, criterion, x, y, precision)


def auto_choice(workload) -> str:
    import opacus_dp.layers as layers
    from opacus_dp.grad_sample.mode_selection import choose_mode

    return choose_mode(workload.build(layers))


# ----------------------------------------------------------------------------- timing
def _precision(args) -> dict:
    """``build_step``'s keyword for ``--precision`` (none for fp32, the default)."""
    precision = getattr(args, "precision", "fp32")
    return {} if precision == "fp32" else {"precision": precision}


def _timer(kind: str) -> Callable[[], float]:
    return time.process_time if kind == "cpu" else time.perf_counter


def time_variants(workload, variants: List[str], args) -> Dict[str, dict]:
    """Median step time of every variant (interleaved rounds, rotating order)."""
    torch.manual_seed(1)
    x, y = workload.batch()
    steps, errors = {}, {}
    for variant in variants:
        try:
            steps[variant] = build_step(workload, variant, x, y, **_precision(args))
            steps[variant]()
        except Exception as e:  # a library that cannot run this model: reported, not fatal
            errors[variant] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            steps.pop(variant, None)
    clock, names = _timer(args.timer), list(steps)
    samples: Dict[str, List[float]] = {v: [] for v in names}
    for round_index in range(args.warmup + args.repeats):
        shift = round_index % max(len(names), 1)
        for variant in names[shift:] + names[:shift]:
            start = clock()
            steps[variant]()
            if round_index >= args.warmup:
                samples[variant].append(clock() - start)
    result = {v: {"ms": 1000 * statistics.median(s), "min_ms": 1000 * min(s),
                  "samples_ms": [1000 * t for t in s]} for v, s in samples.items()}
    result.update({v: {"error": e} for v, e in errors.items()})
    add_paired_ratios(result)
    return result


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


def add_compile_ratios(timing: Dict[str, dict]) -> None:
    """For each compiled variant ``name@backend``, medians over rounds of its time divided by
    ``name``'s eager time (``paired_x_eager``) and by ``non-private@backend``'s time
    (``paired_x_compiled_non_private``)."""
    for v, r in timing.items():
        if COMPILED not in v or not r.get("samples_ms"):
            continue
        name, backend = v.split(COMPILED)
        for key, base in (("paired_x_eager", name), ("paired_x_compiled_non_private",
                                                      f"non-private{COMPILED}{backend}")):
            base_samples = timing.get(base, {}).get("samples_ms")
            if base_samples:
                r[key] = statistics.median(a / b for a, b in zip(r["samples_ms"], base_samples))


def print_compile_ratios(report: dict) -> None:
    """The ``--compile`` rows: compiled ÷ eager, and compiled private ÷ compiled non-private."""
    print(f"\n{'model':12s} {'compiled':22s} {'step ms':>9s} {'x eager':>8s} {'x compiled non-priv':>20s}")
    for model_name, entry in report["models"].items():
        for v, r in entry["raw_timing"].items():
            if COMPILED not in v:
                continue
            if "error" in r:
                print(f"{model_name:12s} {v:22s} n/a: {r['error']}")
                continue
            print(f"{model_name:12s} {v:22s} {r['ms']:9.1f} {_fmt(r.get('paired_x_eager'), '8.2f')} "
                  f"{_fmt(r.get('paired_x_compiled_non_private'), '20.2f')}")


# ----------------------------------------------------------------------------- memory
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def probe_memory(model_name: str, variant: str, steps: int, precision: str = "fp32") -> dict:
    """Run in a fresh process: peak RSS increase of ``steps`` training steps (MiB)."""
    workload = WORKLOADS[model_name]
    torch.manual_seed(1)
    x, y = workload.batch()
    step = build_step(workload, variant, x, y, precision)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status_kb("VmRSS")
    for _ in range(steps):
        step()
    return {"peak_increase_mib": (_status_kb("VmHWM") - baseline) / 1024}


def measure_memory(model_name: str, variant: str, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # 2 MiB pages would round the resident sizes up
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", model_name, variant,
           "--memory-steps", str(args.memory_steps), "--threads", str(args.threads),
           "--precision", getattr(args, "precision", "fp32")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report
def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def summarise(model_name: str, timing: Dict[str, dict], memory: Dict[str, dict]) -> Dict[str, dict]:
    """Ratios to non-private and to Opacus per variant: time against Opacus hooks and
    against Opacus's fastest mode, peak memory against Opacus's leanest mode."""
    ms = {v: r.get("ms") for v, r in timing.items()}
    mib = {v: memory.get(v, {}).get("peak_increase_mib") for v in timing}
    theirs = [v for v in THEIRS if ms.get(v) is not None]
    best = min(theirs, key=lambda v: ms[v]) if theirs else None
    measured = [v for v in theirs if mib.get(v) is not None]
    leanest = min(measured, key=lambda v: mib[v]) if measured else None
    rows = {}
    for v in timing:
        rows[v] = {
            "ms": ms[v], "x_non_private": _ratio(ms[v], ms.get("non-private")),
            "paired_x_non_private": timing[v].get("paired_x_non_private"),
            "speedup_vs_opacus_hooks": _ratio(ms.get("opacus:hooks"), ms[v]),
            "paired_speedup_vs_opacus_hooks": timing[v].get("paired_speedup_vs_opacus_hooks"),
            "speedup_vs_opacus_best": _ratio(ms.get(best), ms[v]) if best else None,
            "peak_mib": mib[v], "mem_x_non_private": _ratio(mib[v], mib.get("non-private")),
            "mem_x_opacus_leanest": _ratio(mib[v], mib.get(leanest)) if leanest else None,
            "error": timing[v].get("error") or memory.get(v, {}).get("error"),
        }
    return rows


def _fmt(value, spec):
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
    return "-".rjust(width) if value is None else format(value, spec)


def print_table(report: dict) -> None:
    head = (f"{'model':12s} {'variant':14s} {'step ms':>9s} {'x non-priv':>10s} {'paired x':>8s} "
            f"{'speedup/Op.hk':>15s} {'paired':>6s} {'speedup/Op.best':>14s} {'peak MiB':>9s} "
            f"{'mem x np':>8s} {'mem x Op.min':>13s}")
    print(head)
    print("-" * len(head))
    for model_name, entry in report["models"].items():
        for v, r in entry["variants"].items():
            if r["error"]:
                print(f"{model_name:12s} {v:14s} n/a: {r['error']}")
                continue
            print(f"{model_name:12s} {v:14s} {_fmt(r['ms'], '9.1f')} {_fmt(r['x_non_private'], '10.2f')} "
                  f"{_fmt(r['paired_x_non_private'], '8.2f')} "
                  f"{_fmt(r['speedup_vs_opacus_hooks'], '15.2f')} "
                  f"{_fmt(r['paired_speedup_vs_opacus_hooks'], '6.2f')} {_fmt(r['speedup_vs_opacus_best'], '14.2f')} "
                  f"{_fmt(r['peak_mib'], '9.1f')} {_fmt(r['mem_x_non_private'], '8.2f')} "
                  f"{_fmt(r['mem_x_opacus_leanest'], '13.2f')}")
        print(f"{'':12s} auto -> {entry['auto']}")


ALLOCATOR_SETTINGS = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "allocator": {k: os.environ[k] for k in ALLOCATOR_SETTINGS if k in os.environ}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(WORKLOADS))
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
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--probe", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="GradScaler is going to stop", category=FutureWarning)
    if args.probe:
        print(json.dumps(probe_memory(*args.probe, steps=args.memory_steps, precision=args.precision)))
        return
    variants = ["non-private"] + [m for m in args.modes.split(",") if m]
    if not args.no_opacus:
        variants += list(THEIRS)
    if args.compile:  # compiled copies of non-private and of our modes, timed in the same rounds
        variants += [f"{v}{COMPILED}{args.compile}" for v in variants if not v.startswith("opacus:")]
    report = {"machine": machine(), "settings": vars(args), "models": {}}
    for model_name in args.models.split(","):
        workload = WORKLOADS[model_name]
        timing = time_variants(workload, variants, args)
        add_compile_ratios(timing)
        memory = {} if args.no_memory else {v: measure_memory(model_name, v, args) for v in timing}
        report["models"][model_name] = {"description": workload.description, "auto": auto_choice(workload),
                                        "variants": summarise(model_name, timing, memory),
                                        "raw_timing": timing, "memory": memory}
        print(f"done: {model_name}", file=sys.stderr)
    report["machine"]["load_average_after"] = os.getloadavg()
    print(f"allocator settings of the timed process: {report['machine']['allocator'] or 'defaults'}; "
          f"precision: {args.precision}")
    print_table(report)
    if args.compile:
        print_compile_ratios(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Cost of per-sample gradients, layer by layer: opacus_dp against Opacus 1.6.

For every case the script times one forward + backward pass (loss = half the squared norm of
the output) in five ways, interleaved repetition by repetition, and reports the median of
each divided by the median of the plain pass:

* ``plain``    the bare module (reference time, in ms);
* ``ours``     wrapped in ``opacus_dp.grad_sample.GradSampleModule``: materialised
               ``p.grad_sample`` of shape ``(B, *p.shape)`` (the ``hooks`` mode);
* ``samplers`` the registered per-layer samplers called from a minimal hook harness, i.e. the
               cost of the formulas alone (``ours - samplers`` is the wrapper's overhead);
* ``bk``       what a DP-SGD step needs from the layer, as the ``bk`` mode computes it:
               forward + backward, per-sample norms, flat clip factors ``min(1, C/‖g_i‖)``
               and the clipped sum ``Σ_i f_i g_i`` (the private counterpart of ``p.grad``;
               per-sample gradients materialised only where the mixed rule finds it cheaper);
* ``opacus``   wrapped in Opacus 1.6's ``GradSampleModule`` (needs ``pip install opacus``).

Materialising per-sample gradients writes ``B`` times the parameter's size, so for layers
with few positions per sample (a 2-D ``Linear``) ``ours`` is bound by memory traffic, not by
arithmetic; ``bk`` is the cost of private training with such a layer.

Usage::

    python scripts/benchmark_layers.py [--repeats 20] [--warmup 3] [--only conv]
                                       [--first-layer] [--clock wall|cpu] [--device cpu]
                                       [--json out.json]

Floating-point inputs require gradients, as for a layer inside a network (plain backward then
also computes the input gradient); ``--first-layer`` times the layers as a network's first
layer instead. Leave ``OMP_NUM_THREADS`` unset for representative CPU figures. Wall-clock
figures are noisy on a shared machine: run it alone, or compare ``--clock cpu`` figures under
``OMP_NUM_THREADS=1``.
"""

import argparse
import inspect
import json
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample import GRAD_SAMPLERS, GradSampleModule
from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule

CLIP = 1.0


@dataclass
class Case:
    """One benchmark row: a model factory, its inputs, and (if its type differs) Opacus' twin."""

    name: str
    shape: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], Tuple[Any, ...]]
    build_opacus: Optional[Callable[[], nn.Module]] = None


def _randn(*shape):
    return lambda: (torch.randn(*shape),)


def _indices(vocab, *shape):
    return lambda: (torch.randint(vocab, shape),)


def _bags(vocab, bags, per_bag):
    """1-D indices with offsets (the form Opacus' EmbeddingBag sampler accepts)."""
    total = bags * per_bag
    return lambda: (torch.randint(vocab, (total,)), torch.arange(0, total, per_bag))


def _dp_layer_cases() -> List[Case]:
    """DPLSTM / DPMultiheadAttention, when both packages provide them."""
    try:
        import opacus.layers as theirs

        import opacus_dp.layers as ours
    except ImportError:
        return []
    qkv = lambda: tuple(torch.randn(32, 32, 128) for _ in range(3))  # noqa: E731
    return [
        Case("DPLSTM", "B32 T16 32->64", lambda: ours.DPLSTM(32, 64, batch_first=True),
             _randn(32, 16, 32), lambda: theirs.DPLSTM(32, 64, batch_first=True)),
        Case("DPMultiheadAttention", "B32 T32 E128 h8",
             lambda: ours.DPMultiheadAttention(128, 8, batch_first=True), qkv,
             lambda: theirs.DPMultiheadAttention(128, 8, batch_first=True)),
    ]


def all_cases() -> List[Case]:
    cases = [
        Case("Linear", "B64 512->512", lambda: nn.Linear(512, 512), _randn(64, 512)),
        Case("Linear (wide)", "B32 1024->1024", lambda: nn.Linear(1024, 1024), _randn(32, 1024)),
        Case("Linear (sequence)", "B32 T64 512->512", lambda: nn.Linear(512, 512),
             _randn(32, 64, 512)),
        Case("Linear (MLP in)", "B32 T128 256->1024", lambda: nn.Linear(256, 1024),
             _randn(32, 128, 256)),
        Case("Linear (MLP out)", "B32 T128 1024->256", lambda: nn.Linear(1024, 256),
             _randn(32, 128, 1024)),
        Case("Conv1d", "B32 32->64 k5 L128", lambda: nn.Conv1d(32, 64, 5, padding=2),
             _randn(32, 32, 128)),
        Case("Conv2d", "B32 3->32 k3 32x32", lambda: nn.Conv2d(3, 32, 3, padding=1),
             _randn(32, 3, 32, 32)),
        Case("Conv2d", "B32 32->64 k3 32x32", lambda: nn.Conv2d(32, 64, 3, padding=1),
             _randn(32, 32, 32, 32)),
        Case("Conv2d", "B32 64->64 k3 56x56", lambda: nn.Conv2d(64, 64, 3, padding=1),
             _randn(32, 64, 56, 56)),
        Case("Conv2d stride 2", "B32 64->128 k3 16x16",
             lambda: nn.Conv2d(64, 128, 3, stride=2, padding=1), _randn(32, 64, 16, 16)),
        Case("Conv2d", "B32 256->256 k3 8x8", lambda: nn.Conv2d(256, 256, 3, padding=1),
             _randn(32, 256, 8, 8)),
        Case("Conv2d depthwise", "B32 64 k3 16x16",
             lambda: nn.Conv2d(64, 64, 3, padding=1, groups=64), _randn(32, 64, 16, 16)),
        Case("Conv3d", "B16 4->16 k3 16^3", lambda: nn.Conv3d(4, 16, 3, padding=1),
             _randn(16, 4, 16, 16, 16)),
        Case("Embedding", "B64 T32 V1000 D64", lambda: nn.Embedding(1000, 64),
             _indices(1000, 64, 32)),
        Case("EmbeddingBag", "B64 bag32 V1000 D64 mean",
             lambda: nn.EmbeddingBag(1000, 64, mode="mean"), _bags(1000, 64, 32)),
        Case("LayerNorm", "B32 T64 D512", lambda: nn.LayerNorm(512), _randn(32, 64, 512)),
        Case("GroupNorm", "B32 64ch g8 32x32", lambda: nn.GroupNorm(8, 64),
             _randn(32, 64, 32, 32)),
        Case("InstanceNorm2d", "B32 64ch 32x32", lambda: nn.InstanceNorm2d(64, affine=True),
             _randn(32, 64, 32, 32)),
    ]
    if hasattr(nn, "RMSNorm"):
        cases.append(Case("RMSNorm", "B32 T64 D512", lambda: nn.RMSNorm(512),
                          _randn(32, 64, 512)))
    cases += _dp_layer_cases()
    qkv = lambda: tuple(torch.randn(32, 32, 128) for _ in range(3))  # noqa: E731
    cases += [
        Case("nn.LSTM", "B32 T16 32->64", lambda: nn.LSTM(32, 64, batch_first=True),
             _randn(32, 16, 32)),
        Case("nn.MultiheadAttention", "B32 T32 E128 h8",
             lambda: nn.MultiheadAttention(128, 8, batch_first=True), qkv),
    ]
    return cases


# ----------------------------------------------------------------------------- runners
def _loss(output) -> torch.Tensor:
    """Half the squared norm of the (first) output: its gradient is the output itself, a dense
    tensor like in real training (``output.sum()`` would give a stride-0 gradient)."""
    first = output[0] if isinstance(output, (tuple, list)) else output
    return 0.5 * first.pow(2).sum()


class SamplerHarness:
    """Minimal hooks that call the registered samplers: no book-keeping, no validation."""

    def __init__(self, model: nn.Module):
        self.results: Dict[torch.Tensor, torch.Tensor] = {}
        covered = set()
        for module in model.modules():
            sampler = GRAD_SAMPLERS.get(type(module))
            if sampler is not None:
                module.register_forward_hook(self._hook(sampler), with_kwargs=True)
                covered.update(id(p) for p in module.parameters(recurse=False))
        if any(id(p) not in covered for p in model.parameters()):
            raise TypeError("some parameters have no registered sampler")

    def _hook(self, sampler):
        def forward_hook(layer, args, kwargs, output):
            bound = inspect.signature(type(layer).forward).bind(layer, *args, **kwargs)
            bound.apply_defaults()
            activations = [v.detach() if isinstance(v, torch.Tensor) else v
                           for v in list(bound.arguments.values())[1:]]
            out = output[0] if isinstance(output, (tuple, list)) else output
            out.register_hook(lambda g: self.results.update(sampler(layer, activations, g)))

        return forward_hook


def _prepare_inputs(case: Case, device: torch.device, input_grad: bool) -> Tuple[Any, ...]:
    inputs = tuple(t.to(device) for t in case.inputs())
    return tuple(t.requires_grad_(input_grad and t.is_floating_point()) for t in inputs)


def _make_step(kind: str, case: Case, device: torch.device, input_grad: bool):
    """A closure running one forward + backward of ``case`` the ``kind`` way."""
    torch.manual_seed(0)
    build = case.build_opacus if (kind == "opacus" and case.build_opacus) else case.build
    model = build().to(device)
    inputs = _prepare_inputs(case, device, input_grad)
    if kind == "ours":
        model = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    elif kind == "opacus":
        from opacus import GradSampleModule as OpacusGradSampleModule

        model = OpacusGradSampleModule(model, batch_first=True, loss_reduction="sum")
    elif kind == "samplers":
        harness = SamplerHarness(model)
    elif kind == "bk":
        model = BookkeepingGradSampleModule(model, batch_first=True, loss_reduction="sum")

    def step():
        model.zero_grad(set_to_none=True)
        if kind == "samplers":
            harness.results.clear()
        _loss(model(*inputs)).backward()
        if kind == "bk":
            clipped_sums(model)

    step()  # fail here (-> n/a) rather than inside the timing loop
    return step


def clipped_sums(model: BookkeepingGradSampleModule) -> List[Optional[torch.Tensor]]:
    """Per-sample norms, flat clip factors ``min(1, C / ‖g_i‖)``, clipped sums (one step's work)."""
    params = [p for p in model.parameters() if p.requires_grad]
    norms = model.per_sample_norms(params)
    total = torch.stack(norms).pow(2).sum(dim=0).sqrt()
    factors = (CLIP / (total + 1e-6)).clamp(max=1.0)
    return model.clipped_sums(params, [factors] * len(params))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(step: Callable[[], None], device: torch.device, clock: Callable[[], float]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start


KINDS = ("plain", "ours", "samplers", "bk", "opacus")


def run_case(case: Case, repeats: int, warmup: int, device: torch.device,
             input_grad: bool = True, clock: str = "wall") -> Dict[str, Any]:
    """Median seconds per kind (None where a kind cannot run the case)."""
    steps, errors = {}, {}
    for kind in KINDS:
        try:
            steps[kind] = _make_step(kind, case, device, input_grad)
        except Exception as error:  # unsupported layer in one of the wrappers: report n/a
            errors[kind] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    times: Dict[str, List[float]] = {kind: [] for kind in steps}
    order = list(steps)
    for rep in range(warmup + repeats):
        order = order[1:] + order[:1]  # rotate so that no kind always runs first
        for kind in order:
            elapsed = _timed(steps[kind], device, CLOCKS[clock])
            if rep >= warmup:
                times[kind].append(elapsed)
    medians = {kind: statistics.median(ts) if ts else None for kind, ts in times.items()}
    return {"layer": case.name, "shape": case.shape,
            "median_s": {k: medians.get(k) for k in KINDS}, "errors": errors}


# ----------------------------------------------------------------------------- report
def _ratio(row, kind, base="plain") -> Optional[float]:
    t, b = row["median_s"].get(kind), row["median_s"].get(base)
    return None if t is None or b is None else t / b


def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(rows: List[Dict[str, Any]]) -> None:
    header = (f"{'layer':22} {'shape':26} {'plain ms':>9} {'ours x':>7} {'samplers x':>10} "
              f"{'bk x':>6} {'opacus x':>8} {'ours/opacus':>11}")
    print(header)
    print("-" * len(header))
    for row in rows:
        plain = row["median_s"]["plain"]
        print(f"{row['layer']:22} {row['shape']:26} {_fmt(plain and plain * 1e3, '9.2f')} "
              f"{_fmt(_ratio(row, 'ours'), '7.2f')} {_fmt(_ratio(row, 'samplers'), '10.2f')} "
              f"{_fmt(_ratio(row, 'bk'), '6.2f')} {_fmt(_ratio(row, 'opacus'), '8.2f')} "
              f"{_fmt(_ratio(row, 'ours', 'opacus'), '11.2f')}")
    for row in rows:
        for kind, why in row["errors"].items():
            print(f"  {row['layer']} [{kind}] n/a: {why}")


def main(argv=None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    parser.add_argument("--only", default="", help="run cases whose name contains this text")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or process CPU time (steadier on a shared machine; "
                             "use with OMP_NUM_THREADS=1)")
    parser.add_argument("--first-layer", action="store_true",
                        help="inputs do not require gradients (a network's first layer)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, "
          f"{args.clock} clock, "
          f"{'first layer' if args.first_layer else 'inner layer'} (input gradients "
          f"{'off' if args.first_layer else 'on'})")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in all_cases():
            if args.only.lower() in case.name.lower():
                rows.append(run_case(case, args.repeats, args.warmup, device,
                                     input_grad=not args.first_layer, clock=args.clock))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()

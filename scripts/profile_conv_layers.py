"""The floor of ``bk`` on a convolutional benchmark model: its per-sample work, layer by layer.

For each convolution of a model of ``scripts/benchmark.py`` (``--model convnet`` or ``resnet``), at
the shapes of the benchmark's batch (recorded in one forward pass), side by side in one process:

* ``weight grad``: the batch weight gradient (``torch.nn.grad.conv2d_weight``): what autograd
  computes in the non-private backward and ``bk`` skips;
* ``bk work``: what ``bk`` computes for the layer instead: where its rule materialises, the
  per-sample gradients (:func:`~opacus_dp.grad_sample.conv.per_sample_conv_weight_grad`), their
  norms and their clipped sum ``Σ_i f_i ∇W_i``; where it takes the ghost norm, the norms ``⟨A Aᵀ, G Gᵀ⟩`` and the
  weighted weight gradient (:mod:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.conv`).

The sum of ``bk work − weight grad`` is the per-sample arithmetic a private step adds. Beside it,
``fixed``: ``bk``'s step minus the non-private step at a batch of 2 (hooks, bookkeeping, clip
factors, noise of these few parameters), and the non-private step at the full batch, so that

    floor = (non-private + Σ (bk work − weight grad) + fixed) / non-private

is what ``bk`` would cost with nothing else: no page faults, no memory effects. Medians of process
CPU time over ``--repeats`` interleaved rounds, one thread.

    OMP_NUM_THREADS=1 python scripts/profile_conv_layers.py --model convnet --repeats 11
"""

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import _ours  # noqa: E402
from benchmark_models import WORKLOADS  # noqa: E402


def median_ms(functions, repeats: int):
    """Median process CPU ms of each function, run in turn in every round (interleaved, so that
    the machine's slow phases hit them alike), after two untimed rounds."""
    times = [[] for _ in functions]
    for _ in range(repeats + 2):
        for function, spent in zip(functions, times):
            start = time.process_time()
            function()
            spent.append(time.process_time() - start)
    return [1000 * statistics.median(spent[2:]) for spent in times]


def recorded_calls(model: nn.Module, x: torch.Tensor):
    """``[(name, layer, input, output gradient)]`` of every ``Conv2d`` in one forward/backward."""
    calls, handles = {}, []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Conv2d):
            def keep(module, args, output, name=name):
                calls[name] = [module, args[0].detach(), None]
                output.register_hook(lambda grad: calls[name].__setitem__(2, grad.detach()))
            handles.append(layer.register_forward_hook(keep))
    model(x).sum().backward()
    for handle in handles:
        handle.remove()
    return [(name, *call) for name, call in calls.items()]


def bk_work(layer: nn.Conv2d, x: torch.Tensor, gy: torch.Tensor):
    """The rule ``bk`` applies to the layer and a function computing what it computes."""
    from opacus_dp.grad_sample.bookkeeping.norm_samplers import conv as ghost
    from opacus_dp.grad_sample.conv import per_sample_conv_weight_grad
    from opacus_dp.maths.per_sample import per_sample_norms, weighted_sum

    factors = torch.rand(x.shape[0])
    if ghost.conv_prefers_ghost(layer, [x]):
        def work():
            ghost._weight_sq_norms_and_bound(layer, x, gy)
            ghost.conv_weighted_grad(layer, [x], gy, {layer.weight: factors})
        return "ghost", work

    def materialise():
        grads = per_sample_conv_weight_grad(layer, x, gy)
        per_sample_norms(grads)
        weighted_sum(factors, grads)
    return "materialised", materialise


def step_function(workload, mode, x, y):
    """One step of the non-private (``mode=None``) or private model on ``(x, y)``."""
    import opacus_dp.layers as layers

    torch.manual_seed(0)
    model = workload.build(layers)
    optimizer, criterion = torch.optim.SGD(model.parameters(), lr=0.05), workload.criterion()
    if mode is not None:
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, criterion = _ours(model, optimizer, loader, mode, criterion, "philox")

    def step():
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("convnet", "resnet"), default="convnet")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--batch-size", type=int, default=None, help="the first B samples of the batch")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = WORKLOADS[args.model]
    torch.manual_seed(1)
    x, y = workload.batch()
    x, y = (x[:args.batch_size], y[:args.batch_size]) if args.batch_size else (x, y)
    torch.manual_seed(0)
    rows, extra = [], 0.0
    print(f"{args.model}: {workload.description}; median process CPU ms of {args.repeats}, one thread\n")
    print(f"{'layer':<14} {'input':<16} {'rule':<13} {'weight grad':>11} {'bk work':>8} {'extra':>7}")
    for name, layer, inputs, gy in recorded_calls(workload.build(None), x):
        rule, work = bk_work(layer, inputs, gy)
        shape = tuple(layer.weight.shape)
        weight_grad, private = median_ms([lambda: torch.nn.grad.conv2d_weight(
            inputs, shape, gy, stride=layer.stride, padding=layer.padding, dilation=layer.dilation,
            groups=layer.groups), work], args.repeats)
        extra += private - weight_grad
        rows.append({"layer": name, "rule": rule, "weight_grad_ms": weight_grad, "bk_ms": private})
        print(f"{name:<14} {'x'.join(map(str, inputs.shape[1:])):<16} {rule:<13} {weight_grad:>11.2f} "
              f"{private:>8.2f} {private - weight_grad:>7.2f}")
    steps = {}
    for label, (bx, by) in (("full", (x, y)), ("two", (x[:2], y[:2]))):
        steps[label] = median_ms([step_function(workload, None, bx, by), step_function(workload, "bk", bx, by)],
                                 args.repeats)
    fixed = steps["two"][1] - steps["two"][0]
    non_private = steps["full"][0]
    floor = (non_private + extra + fixed) / non_private
    print(f"\nper-sample work over the weight gradients: {extra:.2f} ms; fixed (bk − non-private at B = 2): "
          f"{fixed:.2f} ms\nnon-private step {non_private:.2f} ms, bk step {steps['full'][1]:.2f} ms "
          f"({steps['full'][1] / non_private:.2f} ×); floor {floor:.2f} ×")
    return {"layers": rows, "extra_ms": extra, "fixed_ms": fixed, "non_private_ms": non_private,
            "bk_ms": steps["full"][1], "floor": floor}


if __name__ == "__main__":
    main()

"""The two forms of a convolution's patch Gram ``A_i A_iᵀ`` (the ghost norm's input side), timed on
a grid of layers, against the choice of the cost model that picks between them.

For each layer of the grid (input channels × input sizes × kernel sizes × strides, ``padding =
k // 2``, 64 output channels, batch ``--batch-size``), the median process CPU time of
``patch_gram(..., "windows")`` (unfolded windows and one batched product) and of
``patch_gram(..., "autocorrelation")`` (the Grams of the input's phases and the tap sums), and
which one ``_prefers_autocorrelation`` picks. Printed per layer, then the time the model's picks
lose against the faster form of each layer, summed over the grid (``lost ms``), and the layers
where its pick is more than 10 % slower. The constants of the model
(``opacus_dp/grad_sample/bookkeeping/norm_samplers/conv.py``: ``TAP_SUM_COST``, ``UNFOLD_COST``,
``PHASE_COPY_COST``) were fitted to this grid on CPU; another machine (``--device cuda``) can check
them here.

    OMP_NUM_THREADS=1 python scripts/benchmark_patch_gram.py [--channels 3,16,32,64,128] [--sizes 4,8,16,32]
"""

import argparse
import itertools
import statistics
import time

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.norm_samplers.conv import _prefers_autocorrelation, patch_gram
from opacus_dp.maths.heap_threshold import settle_heap

FORMS = ("windows", "autocorrelation")


def _ints(text: str):
    return [int(v) for v in text.split(",") if v]


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median time of ``fn()`` in ms after one untimed call (process CPU time; on CUDA the wall
    clock after synchronising)."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = clock()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        samples.append(1000 * (clock() - start))
    return statistics.median(samples)


def layers(args):
    """The grid's ``(layer, input)`` pairs: inputs at least as large as the kernel, and no input of
    64 or more channels at 32x32 or larger (its windows take seconds)."""
    for channels, size, kernel, stride in itertools.product(args.channels, args.sizes, args.kernels, args.strides):
        if size < kernel or (channels >= 64 and size >= 32):
            continue
        layer = nn.Conv2d(channels, 64, kernel, stride, kernel // 2, bias=False).to(args.device)
        yield layer, torch.randn(args.batch_size, channels, size, size, device=args.device)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=_ints, default=_ints("3,16,32,64,128"))
    parser.add_argument("--sizes", type=_ints, default=_ints("4,8,16,32"))
    parser.add_argument("--kernels", type=_ints, default=_ints("3,5"))
    parser.add_argument("--strides", type=_ints, default=_ints("1,2"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    args = parser.parse_args(argv)
    if args.device.type == "cpu":
        settle_heap()  # as in a private step: layer-sized tensors stay on the heap
    rows = []
    print(f"{'channels':>8s} {'size':>5s} {'kernel':>6s} {'stride':>6s} {'windows ms':>10s} "
          f"{'autocorr. ms':>12s} {'model picks':>16s}")
    with torch.no_grad():
        for layer, x in layers(args):
            times = {form: median_ms(lambda f=form: patch_gram(layer, x, f), args.repeats, args.device)
                     for form in FORMS}
            pick = "autocorrelation" if _prefers_autocorrelation(layer, x) else "windows"
            rows.append(dict(channels=layer.in_channels, size=x.shape[-1], kernel=layer.kernel_size[0],
                             stride=layer.stride[0], pick=pick, **{f"{form}_ms": t for form, t in times.items()}))
            print(f"{layer.in_channels:8d} {x.shape[-1]:5d} {layer.kernel_size[0]:6d} {layer.stride[0]:6d} "
                  f"{times['windows']:10.2f} {times['autocorrelation']:12.2f} {pick:>16s}")
    lost = sum(r[f"{r['pick']}_ms"] - min(r[f"{f}_ms"] for f in FORMS) for r in rows)
    slow = [r for r in rows if r[f"{r['pick']}_ms"] > 1.1 * min(r[f"{f}_ms"] for f in FORMS)]
    print(f"lost ms (the picks against the faster form, summed over {len(rows)} layers): {lost:.2f}; "
          f"picks more than 10 % slower: {len(slow)}")
    for r in slow:
        print(f"  {r['channels']} channels, {r['size']}x{r['size']}, {r['kernel']}x{r['kernel']}, "
              f"stride {r['stride']}: picked {r['pick']}")
    return {"rows": rows, "lost_ms": lost, "slow": slow}


if __name__ == "__main__":
    main()

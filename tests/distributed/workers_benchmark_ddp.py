"""``scripts/benchmark.py --ddp`` on a rank of a spawned gloo job: the step each variant times, built
with ``--ddp``'s wrapper, on the tiny model of ``tests/ghost/test_benchmark_script.py``."""

from types import SimpleNamespace

from torch.nn.parallel import DistributedDataParallel

from tests.ghost.test_benchmark_script import _workload
from tests.script_loading import load_script


def ddp_steps(rank, world_size, variants, clip):
    """Per variant: whether the model the step trains holds a DDP, and ``p.grad`` after one step
    (σ = 0)."""
    bench = load_script("benchmark.py", "benchmark_under_ddp")
    bench.SIGMA, bench.CLIP = 0.0, clip
    wrap = bench.ddp_kwargs(SimpleNamespace(ddp=True))["wrap"]
    workload = _workload(bench)
    x, y = workload.batch()
    results = {}
    for variant in variants:
        step = bench.build_step(workload, variant, x, y, wrap=wrap)
        cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
        if "@" in variant:  # a compiled step learns its calls first: the second step's gradient,
            lr = cells["optimizer"].param_groups[0]["lr"]  # at the same parameters
            cells["optimizer"].param_groups[0]["lr"] = 0.0
            step()
            cells["optimizer"].param_groups[0]["lr"] = lr
        step()
        results[variant] = {
            "ddp": any(isinstance(m, DistributedDataParallel) for m in cells["model"].modules()),
            "grads": [p.grad.detach().clone() for group in cells["optimizer"].param_groups
                      for p in group["params"]]}
    return results

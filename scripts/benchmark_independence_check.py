"""One-time cost of the model-level sample-independence check, relative to one private step.

For a small GPT-2 built from a ``transformers`` config and a small CNN, prints the median time of
the check (:func:`opacus_dp.grad_sample.batch_independence_check.check_samples_alone`: one forward
of the batch without autograd graph, two of one sample) and of one forward/backward pass of the
wrapped model in ``grad_sample_mode`` (the check off), and their ratio.

    python scripts/benchmark_independence_check.py [--mode bk] [--repeats 5] [--device cpu]
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.grad_sample.batch_independence_check import check_samples_alone
from opacus_dp.grad_sample.mode_selection import MODES


def _seconds(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpt2(device, batch: int = 16, length: int = 64):
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=length)
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, 1000, (batch, length), device=device)
    return model, (), {"input_ids": ids}, lambda out: out.logits.float().square().mean()


def cnn(device, batch: int = 64):
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10)).to(device)
    labels = torch.randint(0, 10, (batch,), device=device)
    return model, (torch.randn(batch, 3, 32, 32, device=device),), {}, lambda out: F.cross_entropy(out, labels)


def measure(name, build, mode: str, repeats: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model, args, kwargs, loss_of = build(device)
    row = MODES[mode]
    gsm = row.wrapper(model, check_sample_independence=False, **row.options)

    def step():
        loss_of(gsm(*args, **kwargs)).backward()
        gsm.zero_grad()

    step_s = _seconds(step, repeats, device)
    check_s = _seconds(lambda: check_samples_alone(model, args, kwargs, 0), repeats, device)
    gsm.close()
    print(f"{name:6s} mode={mode:9s} step {step_s * 1e3:8.1f} ms   check {check_s * 1e3:8.1f} ms   "
          f"check/step {check_s / step_s:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bk", choices=sorted(MODES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    options = parser.parse_args()
    device = torch.device(options.device)
    measure("gpt2", gpt2, options.mode, options.repeats, device)
    measure("cnn", cnn, options.mode, options.repeats, device)


if __name__ == "__main__":
    main()

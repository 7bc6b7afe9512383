"""``scripts/benchmark.py`` times what its table names.

Each variant's step is checked against a per-sample autograd oracle: with σ = 0 the gradient
it leaves for SGD is ``1/B · Σ_i clip(g_i)`` (flat: ``C``; ``-per-layer``: ``C/√n`` per tensor),
the non-private one ``1/B · Σ_i g_i``; with the script's σ = 1 it differs from that by Gaussian
noise of std ``σ·C/B`` per coordinate. The report's ratios are checked against hand
computation, a short run against its own raw timings, and the memory probe against the
per-sample gradients the ``hooks`` mode materialises.
"""

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tests.script_loading import load_script

VOCAB, BATCH, LENGTH = 40, 6, 5


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark.py", "benchmark_under_test")


class TinySequenceModel(nn.Module):
    """Embedding, a Linear–Tanh–Linear over positions, mean pooling: the Gram, embedding and
    materialised paths of the norms-only modes all run."""

    def __init__(self, layers=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, tokens):
        return self.body(self.emb(tokens)).mean(dim=1)


def _workload(bench):
    from benchmark_models import Workload

    def batch():
        generator = torch.Generator().manual_seed(5)
        return (torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator),
                torch.randint(0, 3, (BATCH,), generator=generator))

    return Workload("tiny", TinySequenceModel, batch, "test model")


def _per_sample_grads(x, y):
    torch.manual_seed(0)  # build_step's seed: the same initial weights
    model = TinySequenceModel()
    grads = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    return grads


def _expected_gradient(variant, grads, clip):
    count = len(grads[0])
    total = [torch.zeros_like(g) for g in grads[0]]
    for sample in grads:
        if variant == "non-private":
            factors = [1.0] * count
        elif variant.endswith("-per-layer"):
            factors = [min(1.0, clip / count ** 0.5 / float(g.norm())) for g in sample]
        else:
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sample))
            factors = [min(1.0, clip / norm)] * count
        for t, g, f in zip(total, sample, factors):
            t += f * g
    return [t / len(grads) for t in total]


def _gradient_of_one_step(bench, variant, x, y, **options):
    """``p.grad`` after one timed step (SGD without momentum: the update is ``-lr · p.grad``);
    ``options``: more keywords of ``build_step``."""
    step = bench.build_step(_workload(bench), variant, x, y, **options)
    cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
    assert cells["optimizer"].defaults["lr"] == bench.LR and not cells["optimizer"].defaults["momentum"]
    step()
    return [p.grad.detach().clone() for group in cells["optimizer"].param_groups
            for p in group["params"]]


VARIANTS = ["non-private", "hooks", "ghost", "bk", "bk-per-layer", "opacus:hooks", "opacus:ghost"]
# Opacus's full backward hooks fire on the first layer's outputs (its input needs no gradient): torch says so
OPACUS_HOOK_NOTICE = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=OPACUS_HOOK_NOTICE) if v.startswith("opacus:") else v
                                     for v in VARIANTS])
def test_each_variants_step_is_the_update_it_names(bench, monkeypatch, variant):
    if variant.startswith("opacus:"):
        pytest.importorskip("opacus")
    monkeypatch.setattr(bench, "SIGMA", 0.0)
    monkeypatch.setattr(bench, "CLIP", 1.3)  # the norms of this batch: 1.07 … 1.56
    x, y = _workload(bench).batch()
    grads = _per_sample_grads(x, y)
    norms = [math.sqrt(sum(float(g.pow(2).sum()) for g in s)) for s in grads]
    assert min(norms) < bench.CLIP < max(norms)  # clipping is active for some samples only
    expected = _expected_gradient(variant, grads, bench.CLIP)
    got = _gradient_of_one_step(bench, variant, x, y)
    assert len(got) == len(expected)
    for g, want in zip(got, expected):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("variant, fast_noise", [("bk", "off"), ("bk-per-layer", "off"), ("ghost", "off"),
                                                 ("bk", "philox"), ("ghost", "threads")])
def test_the_timed_private_step_adds_noise_of_std_sigma_c_over_b(bench, variant, fast_noise):
    x, y = _workload(bench).batch()
    grads = _per_sample_grads(x, y)
    options = bench._precision(bench.parse_args(["--fast-noise", fast_noise]))
    assert options == ({} if fast_noise == "off" else {"fast_noise": {"philox": "philox", "threads": True}[fast_noise]})
    noise = [g - e for g, e in zip(_gradient_of_one_step(bench, variant, x, y, **options),
                                   _expected_gradient(variant, grads, bench.CLIP))]
    flat = torch.cat([n.flatten() for n in noise]).double()
    want = bench.SIGMA * bench.CLIP / BATCH
    # 515 coordinates: the sample std is within 4 standard errors (√(1/2n) ≈ 3.3 %) of σ_noise
    assert abs(float(flat.std()) / want - 1) < 4 * math.sqrt(1 / (2 * flat.numel()))
    assert abs(float(flat.mean())) < 4 * want / math.sqrt(flat.numel())


def test_summarise_ratios_by_hand(bench):
    timing = {"non-private": {"ms": 100.0, "paired_x_non_private": 1.0},
              "bk": {"ms": 125.0, "paired_x_non_private": 1.2},
              "opacus:hooks": {"ms": 250.0}, "opacus:ghost": {"ms": 200.0}}
    memory = {"non-private": {"peak_increase_mib": 40.0}, "bk": {"peak_increase_mib": 44.0},
              "opacus:hooks": {"peak_increase_mib": 110.0}, "opacus:ghost": {"peak_increase_mib": 55.0}}
    rows = bench.summarise("m", timing, memory)
    assert rows["bk"]["x_non_private"] == pytest.approx(1.25)
    assert rows["bk"]["paired_x_non_private"] == 1.2
    assert rows["bk"]["speedup_vs_opacus_hooks"] == pytest.approx(2.0)
    assert rows["bk"]["speedup_vs_opacus_best"] == pytest.approx(1.6)  # Opacus ghost was faster
    assert rows["bk"]["mem_x_non_private"] == pytest.approx(1.1)
    assert rows["bk"]["mem_x_opacus_leanest"] == pytest.approx(0.8)  # against Opacus ghost, 55 MiB
    assert rows["bk"]["tensor_x_non_private"] is None  # no tensor peak measured
    memory["non-private"]["tensor_peak_mib"], memory["bk"]["tensor_peak_mib"] = 30.0, 36.0
    assert bench.summarise("m", timing, memory)["bk"]["tensor_x_non_private"] == pytest.approx(1.2)
    timing["opacus:ghost"] = {"error": "RuntimeError: unsupported"}
    memory.pop("opacus:ghost")
    rows = bench.summarise("m", timing, memory)
    assert rows["bk"]["speedup_vs_opacus_best"] == pytest.approx(2.0)  # only hooks ran
    assert rows["opacus:ghost"]["error"].startswith("RuntimeError")


def test_paired_ratio_is_the_median_of_per_round_ratios(bench, monkeypatch):
    """Fake steps advance a fake clock by scripted times (the first, untimed call right after
    building a step by 0): the plain ratio follows the medians, the paired one the rounds."""
    clock = SimpleNamespace(now=0.0)
    scripted = {"non-private": [0.0, 1.0, 3.0, 2.0], "bk": [0.0, 2.0, 3.3, 2.1],
                "opacus:hooks": [0.0, 3.0, 6.6, 6.3]}

    def build(workload, variant, x, y):
        times = iter(scripted[variant])

        def step():
            clock.now += next(times)
        return step

    monkeypatch.setattr(bench, "build_step", build)
    monkeypatch.setattr(bench, "_timer", lambda kind: lambda: clock.now)
    workload = SimpleNamespace(batch=lambda: (None, None))
    result = bench.time_variants(workload, ["non-private", "bk", "opacus:hooks"],
                                 SimpleNamespace(warmup=0, repeats=3, timer="cpu"))
    assert result["non-private"]["ms"] == pytest.approx(2000.0)
    assert result["bk"]["ms"] == pytest.approx(2100.0)  # ratio of the medians: 1.05
    assert result["bk"]["paired_x_non_private"] == pytest.approx(1.1)  # rounds: 2.0, 1.1, 1.05
    # Opacus hooks / bk per round: 1.5, 2.0, 3.0 (ratio of the medians: 6.3 / 2.1 = 3.0)
    assert result["bk"]["paired_speedup_vs_opacus_hooks"] == pytest.approx(2.0)
    assert result["opacus:hooks"]["paired_speedup_vs_opacus_hooks"] == pytest.approx(1.0)
    rows = bench.summarise("m", result, {})
    assert rows["bk"]["paired_speedup_vs_opacus_hooks"] == pytest.approx(2.0)
    assert rows["bk"]["speedup_vs_opacus_hooks"] == pytest.approx(3.0)


@pytest.mark.skipif(importlib.util.find_spec("resource") is None, reason="getrusage is POSIX")
def test_faults_column_counts_the_pages_a_step_touches_first(bench, monkeypatch):
    """A step that writes one byte into each page of a fresh 4 MiB anonymous mapping faults about
    1024 times; a step that touches nothing new about never."""
    import mmap

    pages = (4 << 20) // mmap.PAGESIZE

    def build(workload, variant, x, y):
        def fresh_pages():
            with mmap.mmap(-1, pages * mmap.PAGESIZE) as mapping:
                if hasattr(mmap, "MADV_NOHUGEPAGE"):  # base pages whatever the kernel's huge-page setting
                    mapping.madvise(mmap.MADV_NOHUGEPAGE)
                for page in range(pages):
                    mapping[page * mmap.PAGESIZE] = 1

        return fresh_pages if variant == "bk" else (lambda: None)

    monkeypatch.setattr(bench, "build_step", build)
    workload = SimpleNamespace(batch=lambda: (None, None))
    result = bench.time_variants(workload, ["non-private", "bk"], SimpleNamespace(warmup=1, repeats=3, timer="cpu"))
    assert pages * 0.9 <= result["bk"]["faults"] <= pages * 1.5
    assert result["non-private"]["faults"] < pages * 0.05
    assert bench.summarise("m", result, {})["bk"]["faults"] == result["bk"]["faults"]


@OPACUS_HOOK_NOTICE
def test_short_run_reports_every_variant_consistently(bench, tmp_path, capsys):
    out = tmp_path / "report.json"
    bench.main(["--models", "lstm", "--modes", "bk", "--repeats", "1", "--warmup", "0",
                "--no-memory", "--threads", "1", "--timer", "cpu", "--json", str(out)])
    report = json.loads(out.read_text())
    entry = report["models"]["lstm"]
    assert entry["auto"] == "bk"
    rows = entry["variants"]
    expected = {"non-private", "bk"} | ({"opacus:hooks", "opacus:ghost"}
                                       if importlib.util.find_spec("opacus") else set())
    assert set(rows) == expected
    for variant, row in rows.items():
        assert row["error"] is None, row["error"]
        raw = entry["raw_timing"][variant]["samples_ms"]
        assert len(raw) == 1 and row["ms"] == pytest.approx(raw[0]) and row["ms"] > 0
        assert row["x_non_private"] == pytest.approx(row["ms"] / rows["non-private"]["ms"])
    printed = capsys.readouterr().out
    assert "lstm" in printed
    from opacus_dp.maths.cpu_products import cpu_products  # the backend in effect is reported

    assert report["machine"]["cpu_products"] == cpu_products()
    assert f"clipped sums' CPU products: {cpu_products()}" in printed


def test_allocated_peak_counts_the_tensors_alive_at_once(bench):
    """4 MiB, then 8 MiB with it (12 MiB alive), then 2 MiB once the 4 MiB is gone: a 12 MiB peak;
    freeing a tensor made before the window neither adds nor lowers the count."""
    mib = 2 ** 20 // 4  # float32 elements in one MiB
    before = torch.empty(12 * mib)

    def run():
        nonlocal before
        a = torch.empty(4 * mib)
        b = torch.empty(8 * mib)
        del a
        before = None
        c = torch.empty(2 * mib)
        del b, c

    assert bench.allocated_peak_mib(run) == pytest.approx(12.0, abs=0.01)
    assert bench.allocated_peak_mib(lambda: None) == 0.0


def test_memory_probe_sees_the_per_sample_gradients_of_hooks(bench):
    """The LSTM's embedding alone has 5000 × 64 parameters: ``hooks`` materialises them per
    sample (32 × 1.2 MiB), which the probe must see as a far higher peak than non-private."""
    args = SimpleNamespace(threads=1, memory_steps=1)
    plain = bench.measure_memory("lstm", "non-private", args)
    hooks = bench.measure_memory("lstm", "hooks", args)
    assert "error" not in plain and "error" not in hooks, (plain, hooks)
    assert plain["peak_increase_mib"] > 0
    assert hooks["peak_increase_mib"] - plain["peak_increase_mib"] > 30
    assert plain["tensor_peak_mib"] > 0  # the same 39 MiB of per-sample gradients, counted as tensors
    assert hooks["tensor_peak_mib"] - plain["tensor_peak_mib"] > 30


class TinyImageModel(nn.Module):
    def __init__(self, layers=None):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x):
        return self.body(x)


def _image_workload():
    from benchmark_models import Workload

    def batch():
        generator = torch.Generator().manual_seed(6)
        return torch.randn(BATCH, 3, 6, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)

    return Workload("tiny-images", TinyImageModel, batch, "test image model")


@pytest.mark.parametrize("variant", ["non-private", "hooks", "bk"])
def test_channels_last_lays_out_model_and_batch_and_trains_the_same(bench, monkeypatch, variant):
    """``--channels-last``: the batch and the convolution's weight in ``torch.channels_last``, and
    the step's gradient that of the default layout (σ = 0)."""
    monkeypatch.setattr(bench, "SIGMA", 0.0)
    workload = _image_workload()
    x, y = bench._batch(workload, SimpleNamespace(channels_last=True))
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    plain_x, _ = bench._batch(workload, SimpleNamespace())
    assert plain_x.is_contiguous() and torch.equal(plain_x, x)
    gradients = {}
    for layout, batch in (("channels-last", x), ("default", plain_x)):
        step = bench.build_step(workload, variant, batch, y, **bench._precision(
            SimpleNamespace(channels_last=layout == "channels-last")))
        cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
        params = [p for group in cells["optimizer"].param_groups for p in group["params"]]
        conv_weight = params[0]
        assert conv_weight.is_contiguous(memory_format=torch.channels_last) == (layout == "channels-last")
        assert conv_weight.is_contiguous() == (layout == "default")
        step()
        gradients[layout] = [p.grad.detach().clone() for p in params]
    for got, want in zip(gradients["channels-last"], gradients["default"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_memory_probe_is_asked_for_the_same_layout_and_noise(bench, monkeypatch):
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        return SimpleNamespace(returncode=0, stdout='{"peak_increase_mib": 1.0, "tensor_peak_mib": 1.0}\n')

    monkeypatch.setattr(bench.subprocess, "run", run)
    bench.measure_memory("convnet", "bk", SimpleNamespace(threads=1, memory_steps=1, channels_last=True,
                                                          fast_noise="philox"))
    bench.measure_memory("convnet", "bk", SimpleNamespace(threads=1, memory_steps=1))
    assert "--channels-last" in seen[0] and "--channels-last" not in seen[1]
    assert seen[0][seen[0].index("--fast-noise") + 1] == "philox" and "--fast-noise" not in seen[1]

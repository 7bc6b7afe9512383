"""``scripts/gpu_benchmark.sh`` and what it adds to ``scripts/benchmark.py``.

* The whole pipeline on CPU (``--device cpu``: tiny batches, one timed round, no memory
  subprocesses) writes one markdown table with a row per workload and variant; with one round
  every ratio is the quotient of the two times it names, which the test recomputes from the
  table's own times.
* The ``llama`` model: with σ = 0 and a clipping bound far above every per-sample norm, the
  private step's update is the non-private one; the oracle is plain autograd of the mean
  next-token cross-entropy on a copy of the model.
* ``compile_stats`` counts a graph break that Dynamo must make (``print``, a Python branch on
  ``Tensor.item()``) and none in straight tensor code, as ``torch._dynamo.explain`` does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.script_loading import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
OURS = ("non-private", "hooks", "ghost", "bk")


@pytest.fixture(autouse=True)
def scripts_importable(monkeypatch):
    """``benchmark_models`` and ``compile_stats`` importable by every test, whatever ran before."""
    monkeypatch.syspath_prepend(str(SCRIPTS))


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark.py", "benchmark_gpu_under_test")


# ----------------------------------------------------------------------------- the pipeline
def _table(text: str):
    """Rows of the markdown table as dicts keyed by its header."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert set(lines[1].strip("|").split("|")) == {"---"}
    return [dict(zip(head, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def _quotient_bounds(a: str, b: str, decimals_a: int, decimals_b: int):
    """Interval of ``A / B`` for times printed as ``a`` and ``b`` (rounded), widened by the
    ratio's own rounding to 2 decimals."""
    da, db = 0.5 * 10 ** -decimals_a, 0.5 * 10 ** -decimals_b
    return (float(a) - da) / (float(b) + db) - 0.005, (float(a) + da) / (float(b) - db) + 0.005


def _check_quotient(row, ratio_key, base_row, decimals):
    low, high = _quotient_bounds(row["step ms"], base_row["step ms"], decimals, decimals)
    assert low <= float(row[ratio_key]) <= high, (row, base_row)


@pytest.mark.slow
def test_cpu_pipeline_writes_one_table_with_a_row_per_workload(tmp_path):
    pytest.importorskip("transformers")  # the llama model
    out = tmp_path / "table.md"
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_benchmark.sh"), "--device", "cpu", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert text.count("\n| workload |") == 1 and "Device: CPU (" in text
    rows = _table(text)
    by_key = {(r["workload"], r["setting"], r["variant"]): r for r in rows}
    fsdp = [r for r in rows if r["workload"].startswith("fsdp2")]
    assert {r["variant"] for r in fsdp} == {"fsdp", "dp-fsdp-bk", "dp-fsdp-hooks", "dp-fsdp-ghost", "ddp",
                                           "dp-ddp-bk"}
    for model in ("convnet", "sequence", "llama"):
        for setting in ("fp32", "bf16"):
            base = by_key[(model, setting, "non-private")]
            for variant in OURS:
                row = by_key[(model, setting, variant)]
                _check_quotient(row, "x non-private", base, 1)
    compiled = {k[2]: r for k, r in by_key.items() if k[1].startswith("fp32, compile")}
    for variant in OURS:
        row = compiled[f"{variant}@aot_eager"]
        _check_quotient(row, "x non-private", compiled["non-private@aot_eager"], 1)
        _check_quotient(row, "x eager", compiled[variant], 1)
        assert int(row["graphs"]) >= 1 and int(row["graph breaks"]) >= 0
    assert compiled["non-private@aot_eager"]["graph breaks"] == "0"
    in_ddp = {k[2]: r for k, r in by_key.items() if k[1].startswith("fp32, DDP W=1, compile")}
    for variant in OURS:  # the same model in DDP (a process group of one process)
        row = in_ddp[f"{variant}@aot_eager"]
        _check_quotient(row, "x non-private", in_ddp["non-private@aot_eager"], 1)
        _check_quotient(row, "x eager", in_ddp[variant], 1)
    for row in fsdp:
        base = "ddp" if "ddp" in row["variant"] else "fsdp"
        _check_quotient(row, "x non-private", next(r for r in fsdp if r["variant"] == base), 2)


# ----------------------------------------------------------------------------- llama
def _tiny_llama():
    pytest.importorskip("transformers")
    from benchmark_models import llama_workload

    return llama_workload(batch=3, length=6, vocab=40, layers=1, hidden=16, heads=2, intermediate=24)


def _oracle_gradient(workload, x, y):
    """Plain autograd of the mean next-token loss over all B·T tokens, same initial weights."""
    torch.manual_seed(0)  # build_step's seed
    model = workload.build(None)
    logits = model(input_ids=x).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("variant", ["non-private", "bk", "ghost", "hooks"])
def test_llama_private_step_without_noise_and_clipping_is_the_plain_update(bench, monkeypatch, variant):
    workload = _tiny_llama()
    monkeypatch.setattr(bench, "SIGMA", 0.0)
    monkeypatch.setattr(bench, "CLIP", 1e6)
    torch.manual_seed(1)
    x, y = workload.batch()
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels: the inputs shifted by one token
    want = _oracle_gradient(workload, x, y)
    step = bench.build_step(workload, variant, x, y)
    cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
    params = {name.split("_module.")[-1]: p for name, p in cells["model"].named_parameters()}
    assert set(params) == set(want)
    before = {name: p.detach().clone() for name, p in params.items()}
    step()
    for name, p in params.items():  # SGD without momentum: p ← p − lr · p.grad
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-9)
        rounding = 2 * torch.finfo(p.dtype).eps * float(before[name].abs().max())  # of p − lr · g
        torch.testing.assert_close(before[name] - p.detach(), bench.LR * want[name], rtol=1e-4, atol=rounding)


def test_next_token_loss_reductions_by_hand():
    from benchmark_models import NextTokenLoss

    logits, labels = torch.randn(2, 3, 5), torch.tensor([[0, 4, 2], [1, 1, 3]])
    per_sequence = torch.stack([
        sum(-torch.log_softmax(logits[i, t], -1)[labels[i, t]] for t in range(3)) / 3 for i in range(2)])
    torch.testing.assert_close(NextTokenLoss("none")(logits, labels), per_sequence)
    torch.testing.assert_close(NextTokenLoss()(logits, labels), per_sequence.mean())
    torch.testing.assert_close(NextTokenLoss("sum")(logits, labels), per_sequence.sum())


# ----------------------------------------------------------------------------- graph breaks
def _item_branch(x):
    y = x * 2
    if y.sum().item() > 0:  # data-dependent Python branch: Dynamo stops here
        y = y + 1
    return y.sin()


def _prints(x):
    y = x * 2
    print("between the graphs")
    return y.cos()


def _clean(x):
    return (x * 2).sin().sum()


@pytest.mark.parametrize("fn,breaks,graphs", [(_item_branch, 1, 2), (_prints, 1, 2), (_clean, 0, 1)])
def test_graph_break_counter(fn, breaks, graphs):
    sys.path.insert(0, str(SCRIPTS))
    import compile_stats

    x = torch.randn(5)
    stats = compile_stats.graph_stats(fn, x)
    assert (stats["graph_breaks"], stats["graphs"]) == (breaks, graphs)
    assert len(stats["break_reasons"]) == breaks
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(x)
    assert (explained.graph_break_count, explained.graph_count) == (breaks, graphs)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_compiled_variants_report_their_graphs(bench, monkeypatch, tmp_path):
    """``--compile eager``: every compiled variant gets its counts; the plain model compiles into
    one graph without breaks (as ``torch._dynamo.explain`` of the same model says)."""
    from benchmark_models import Workload

    def build(layers=None):
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    def batch():
        return torch.randn(5, 4), torch.randint(0, 3, (5,))

    monkeypatch.setitem(bench.WORKLOADS, "tiny", Workload("tiny", build, batch, "test model"))
    # main raises the recompile limit: set back by assignment after the test (monkeypatch's undo
    # deletes a torch config entry it did not find in the module's __dict__, hiding it for later tests)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    limit = getattr(config, name)
    out = tmp_path / "report.json"
    try:
        bench.main(["--models", "tiny", "--modes", "bk", "--no-opacus", "--no-memory", "--repeats", "1",
                    "--warmup", "0", "--threads", "1", "--compile", "eager", "--json", str(out)])
    finally:
        setattr(config, name, limit)
    timing = json.loads(out.read_text())["models"]["tiny"]["raw_timing"]
    assert "graphs" not in timing["bk"] and "graphs" not in timing["non-private"]
    plain, private = timing["non-private@eager"]["graphs"], timing["bk@eager"]["graphs"]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(build())(batch()[0])
    assert (plain["graphs"], plain["graph_breaks"]) == (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert private["graphs"] >= 1 and private["graph_breaks"] >= 0

"""The seams matrix: grad_sample_mode × reduction (local, DDP, FSDP2) × noise mechanism ×
{BatchMemoryManager, empty local batch, resume, fp16 GradScaler}.

Each cell either matches an independent oracle — per-sample autograd on the batches the run drew,
clipped by hand and averaged over the expected global batch (σ = 0), and a replay of the
accountant's history by hand from the mechanism's definition — or is refused by ``make_private``
with a message naming what to change (the table ``REFUSED``). Every reduction's cells run in one
spawned job under a timeout: a hang fails the test and names the cell it happened in.
"""

import math
import os
import re
import tempfile

import pytest
import torch

from tests.distributed.oracle import clipped_sum, per_sample_grads, sgd_step
from tests.distributed.spawn import run_on_ranks
from tests.seams import cells as seams

pytestmark = [pytest.mark.slow]

# (reduction, mechanism, mode, seam) patterns refused up front, with the words the message must hold
REFUSED = [
    (("fsdp2", "banded|tree|blt", ".*", ".*"), r"FSDP2|fully_shard"),
]
JOB_TIMEOUT_S = {"local": 300, "ddp": 420, "fsdp2": 300}
FP16_TOLERANCE, FP32_TOLERANCE = 2e-2, 1e-5


def expected_refusal(cell):
    for (reduction, mechanism, mode, seam), words in REFUSED:
        if all(re.fullmatch(p, v) for p, v in zip((reduction, mechanism, mode, seam),
                                                     (cell.reduction, cell.mechanism, cell.mode, cell.seam))):
            return words
    return None


def _row_index(x_row: torch.Tensor, table: torch.Tensor) -> int:
    hits = torch.nonzero((table == x_row).all(dim=1)).view(-1)
    assert len(hits) == 1, "a drawn row is not one example of the dataset"
    return int(hits[0])


def oracle_final(results, cell):
    """Replay: each logical step's batches of every rank, per-sample autograd, flat clipping, ÷ B."""
    model = seams.make_model()
    for p, s in zip(model.parameters(), results[0]["start"]):
        assert torch.equal(p.detach(), s), "every rank starts from the model the oracle starts from"
    loss = torch.nn.CrossEntropyLoss()
    for step in range(len(results[0]["batches"])):
        pieces = [piece for rank in results for piece in rank["batches"][step]]
        x = torch.cat([p[0] for p in pieces])
        y = torch.cat([p[1] for p in pieces])
        params = [p for p in model.parameters()]
        total = clipped_sum(per_sample_grads(model, loss, x, y), seams.CLIP, params)
        sgd_step(model, [t / results[0]["divisor"] for t in total], seams.LR)
    return [p.detach() for p in model.parameters()]


def expected_rates(cell, sample_rate: float, steps: int):
    """Per step: the rate the mechanism's analysis charges (independent: q each step; banded: the
    group rate b·q at each round's first step, else 0; tree/blt: 1 at the first step, else 0)."""
    if cell.mechanism == "independent":
        return [sample_rate] * steps
    if cell.mechanism == "banded":
        return [min(1.0, seams.BANDS * sample_rate) if t % seams.BANDS == 0 else 0.0 for t in range(steps)]
    return [1.0 if t == 0 else 0.0 for t in range(steps)]


def per_step_rates(history):
    return [q for _, q, n in history for _ in range(n)]


def period_of(cell) -> int:
    """Steps between an example's turns: ``b`` (banded), the steps of a pass ``S`` (tree, blt)."""
    if cell.mechanism == "banded":
        return seams.BANDS
    replicas = cell.world_size if cell.reduction == "ddp" else 1
    return math.ceil(seams.N_SAMPLES / (seams.batch_size_of(cell) * replicas))


def check_participation(cell, results, table):
    """Correlated mechanisms: every example belongs to one slot, so all the steps it is drawn at
    are distinct and congruent modulo the period (banded: at most once in any b consecutive steps)."""
    if cell.mechanism == "independent":
        return
    period, seen = period_of(cell), {}
    for step in range(len(results[0]["batches"])):
        for rank in results:
            for x, _ in rank["batches"][step]:
                for row in x:
                    seen.setdefault(_row_index(row, table), []).append(step)
    for index, steps in seen.items():
        assert len(set(steps)) == len(steps) and len({t % period for t in steps}) == 1, (
            f"{cell.name}: example {index} drawn at steps {steps} (period {period})")


def check_cell(cell, results):
    words = expected_refusal(cell)
    first = results[0]
    for rank in results:
        assert "error" not in rank, f"{cell.name} raised after make_private: {rank['error']}"
    if words is not None:
        assert all("refused" in r for r in results), f"{cell.name} should be refused by make_private"
        assert re.search(words, first["message"]), f"{cell.name}: unclear refusal {first['message']!r}"
        return
    assert "refused" not in first, f"{cell.name} refused: {first.get('message')}"
    steps = len(first["batches"])
    assert steps == seams.steps_of(cell)
    table = seams.dataset().tensors[0]
    # the seam was exercised
    if cell.seam == "bmm":
        assert first["pieces"] > steps
    if cell.seam == "empty":
        assert sum(r["empty_local"] for r in results) > 0, f"{cell.name}: no empty local batch drawn"
    # the update equals the oracle's on the data drawn
    tolerance = FP16_TOLERANCE if cell.seam == "fp16" else FP32_TOLERANCE
    want = oracle_final(results, cell)
    for got, w in zip(first["final"], want):
        assert torch.allclose(got, w, rtol=tolerance, atol=tolerance * 0.1), (
            f"{cell.name}: max |Δ| {float((got - w).abs().max()):.3g}")
    for rank in results[1:]:
        for a, b in zip(rank["final"], first["final"]):
            assert torch.equal(a, b), f"{cell.name}: ranks disagree on the parameters"
    # the accountant's history, replayed by hand
    sample_rate = first["divisor"] / seams.N_SAMPLES
    got_rates = per_step_rates(first["history"])
    want_rates = expected_rates(cell, sample_rate, steps)
    assert len(got_rates) == steps
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got_rates, want_rates)), (
        f"{cell.name}: history {first['history']} charges {got_rates}, expected {want_rates}")
    for rank in results[1:]:
        assert rank["history"] == first["history"], f"{cell.name}: ranks disagree on the history"
    check_participation(cell, results, table)


def _job(reduction, world, remaining, timeout):
    with tempfile.TemporaryDirectory() as directory:
        progress = os.path.join(directory, "progress")
        try:
            return run_on_ranks(seams.run_cells, world, reduction, progress, sorted(remaining), timeout=timeout)
        except TimeoutError:
            started = {}
            for rank in range(world):
                path = f"{progress}.rank{rank}"
                lines = open(path).read().split() if os.path.exists(path) else []
                started[rank] = lines[-1] if lines else None
            pytest.fail(f"the {reduction} cells hung; last cell started per rank: {started}")


def _run(reduction):
    """Every cell's results per rank: one job, and another after each cell that raised."""
    world = 1 if reduction == "local" else 2
    remaining = {cell.name for cell in seams.cells(reduction)}
    merged = [{} for _ in range(world)]
    while remaining:
        results = _job(reduction, world, remaining, JOB_TIMEOUT_S[reduction])
        done = set.intersection(*(set(r) for r in results))
        assert done, f"a {reduction} job ended without finishing a cell: {sorted(remaining)[:3]} ..."
        for into, result in zip(merged, results):
            into.update({name: result[name] for name in done})
        remaining -= done
    return merged


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", seams.REDUCTIONS)
def test_seams(reduction):
    results = _run(reduction)
    failures = []
    for cell in seams.cells(reduction):
        try:
            check_cell(cell, [r[cell.name] for r in results])
        except AssertionError as failure:
            failures.append(str(failure).split("\n")[0][:400])
    assert not failures, f"{len(failures)} cells failed:\n" + "\n".join(failures)

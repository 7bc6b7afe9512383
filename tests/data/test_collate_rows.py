"""One row per example (``opacus_dp/data/collate_rows.py``): a DP loader refuses a collate_fn that
packs examples into one row or spreads one over several, at construction where the collates of one
and two examples show it, else at the first batch that has more rows than examples.

Oracle for why: with σ = 0 and every example's gradient far above C, the clipped sum a row-wise
clipping gives for such a batch exceeds the per-example bound (checked by hand below)."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from opacus_dp import PrivacyEngine
from opacus_dp.data import DPDataLoader
from opacus_dp.data.collate_rows import BatchLayoutWarning, RowsPerExampleError

pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")


class Tokens(Dataset):
    """Example ``i``: 4 token ids and a label."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"input_ids": torch.arange(4) + i, "label": i % 2}


def packing(features):
    """Sequence packing: every example's tokens concatenated into one row."""
    return {"input_ids": torch.cat([f["input_ids"] for f in features]).unsqueeze(0),
            "label": torch.tensor([[f["label"] for f in features]])}


def two_views(features):
    """Two views of each example stacked as rows (2n rows, labels repeated)."""
    ids = torch.stack([f["input_ids"] for f in features])
    return {"input_ids": torch.cat([ids, ids.flip(1)]),
            "label": torch.tensor([f["label"] for f in features] * 2)}


def grows_late(features):
    """One row per example for batches of up to 2 examples, a duplicated row beyond."""
    batch = default_collate(features)
    if len(features) > 2:
        batch = {k: torch.cat([v, v[:1]]) for k, v in batch.items()}
    return batch


def drops_odd(features):
    """Drops examples with an odd first token (as a collate skipping unreadable examples does)."""
    kept = [f for f in features if int(f["input_ids"][0]) % 2 == 0] or features[:1]
    return default_collate(kept)


def with_constant(features):
    """A per-batch constant beside the examples (class weights)."""
    batch = default_collate(features)
    batch["class_weights"] = torch.tensor([1.0, 2.0])
    return batch


def unique_only(features):
    """Refuses a repeated example: the layout cannot be learned, nothing is checked."""
    if len({int(f["input_ids"][0]) for f in features}) != len(features):
        raise ValueError("duplicate")
    return default_collate(features)


@pytest.mark.parametrize("collate, field, shapes", [
    (packing, "batch['input_ids']", "(1, 4) for one example and (1, 8) for two"),
    (two_views, "batch['input_ids']", "(2, 4) for one example and (4, 4) for two"),
])
def test_a_collate_without_one_row_per_example_is_refused_when_the_loader_is_built(collate, field, shapes):
    with pytest.raises(RowsPerExampleError, match="one row per example") as caught:
        DPDataLoader(Tokens(), sample_rate=0.5, collate_fn=collate)
    assert field in str(caught.value) and shapes in str(caught.value)


def test_make_private_refuses_a_packing_collate_before_any_step():
    model = nn.Sequential(nn.Embedding(20, 3), nn.Flatten(), nn.Linear(12, 2))
    loader = DataLoader(Tokens(), batch_size=4, collate_fn=packing)
    with pytest.raises(RowsPerExampleError, match="DataCollatorWithFlattening"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)


def test_a_batch_with_more_rows_than_examples_is_refused_when_it_is_collated():
    loader = DPDataLoader(Tokens(), sample_rate=0.99, collate_fn=grows_late, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RowsPerExampleError, match=r"returned \d+ rows in dimension 0 of batch\['input_ids'\] for a "
                                                  r"batch of \d+ examples"):
        next(iter(loader))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_check_runs_in_worker_processes_too(num_workers):
    loader = DPDataLoader(Tokens(), sample_rate=0.99, collate_fn=grows_late, num_workers=num_workers,
                          generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="rows in dimension 0"):
        list(loader)


@pytest.mark.parametrize("collate", [drops_odd, with_constant, unique_only, None])
def test_collates_that_keep_at_most_one_row_per_example_are_accepted(collate):
    loader = DPDataLoader(Tokens(), sample_rate=0.5, collate_fn=collate, generator=torch.Generator().manual_seed(1))
    sizes = [batch["input_ids"].shape[0] for batch in loader]
    assert len(sizes) == len(loader) and max(sizes) > 1


def test_sequence_first_examples_are_one_row_per_example_on_their_own_dimension():
    """The example dimension is learned per tensor: a sequence-first ``(T, n)`` tensor is checked
    on dimension 1 (a batch of n examples with T = 4 > n passes)."""
    def sequence_first(features):
        batch = default_collate(features)
        return {"input_ids": batch["input_ids"].t(), "label": batch["label"]}

    loader = DPDataLoader(Tokens(), sample_rate=0.2, collate_fn=sequence_first, batch_first=False,
                          generator=torch.Generator().manual_seed(2))
    assert loader.collate_fn.layout == [(("input_ids",), (1,)), (("label",), (0,))]
    assert all(batch["input_ids"].shape[0] == 4 for batch in loader)


def test_row_wise_clipping_of_two_views_exceeds_the_per_example_bound():
    """Why the refusal: with two rows per example clipped to C each, one example's share of the
    clipped sum is up to 2C (σ = 0, a batch of one example, every row's gradient far above C)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    x = 100 * torch.randn(1, 4)
    rows = torch.cat([x, 0.5 * x])  # two views of the one example (a brightness change)
    clipped = torch.zeros(4)
    for row in rows:  # per-row clipping to C = 1, the per-sample oracle
        model.zero_grad()
        model(row).sum().backward()
        g = model.weight.grad.view(-1)
        clipped += g * min(1.0, 1.0 / (g.norm().item() + 1e-6))
    assert clipped.norm() == pytest.approx(2.0, rel=1e-5)


def sequence_first_pairs(features):
    """``(T, n, d)`` inputs and ``(T, n)`` per-position labels."""
    batch = default_collate(features)
    return batch["input_ids"].t().unsqueeze(-1).float(), batch["input_ids"].t() % 2


@pytest.mark.parametrize("batch_first, warned", [(True, True), (False, False)])
def test_sequence_first_batches_with_batch_first_true_are_warned_about(batch_first, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DPDataLoader(Tokens(), sample_rate=0.5, collate_fn=sequence_first_pairs, batch_first=batch_first)
    layout = [w for w in caught if issubclass(w.category, BatchLayoutWarning)]
    assert bool(layout) == warned
    if warned:
        assert "dimension 1 of batch[0] (shape (4, 1, 1) for one example), but batch_first=True" in str(layout[0].message)


def test_make_private_warns_about_sequence_first_batches_read_batch_first():
    model = nn.Linear(1, 2)
    loader = DataLoader(Tokens(), batch_size=4, collate_fn=sequence_first_pairs)
    with pytest.warns(BatchLayoutWarning, match="pass batch_first=False"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)


def test_batch_first_batches_are_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchLayoutWarning)
        DPDataLoader(Tokens(), sample_rate=0.5)
        DPDataLoader(Tokens(), sample_rate=0.5, collate_fn=with_constant)

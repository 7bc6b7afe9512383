"""DPTrainer refuses what would break the per-example bound or be silently ignored: a data
collator that packs examples into one row or spreads one over several rows (the Poisson loader's
one-row-per-example check, ``opacus_dp/data/collate_rows.py``), ``label_smoothing_factor`` and the
Trainer's ``compute_loss_func`` (the private step trains on one loss per example)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opacus_dp.data.collate_rows import RowsPerExampleError  # noqa: E402
from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402
from tests.integrations.hf_trainer_support import TokenBlocks, tiny_model, training_args  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

PRIVACY = PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0)


def train(tmp_path, collator=None, **overrides):
    trainer = DPTrainer(model=tiny_model(), args=training_args(tmp_path, max_steps=2, **overrides),
                        train_dataset=TokenBlocks(), data_collator=collator, privacy_args=PRIVACY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def without_index(features):
    return [{k: v for k, v in f.items() if k != "index"} for f in features]


def two_views(features):
    """Each example and its reversed tokens as two rows."""
    ids = torch.stack([f["input_ids"] for f in features])
    ids = torch.cat([ids, ids.flip(1)])
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.skipif(not hasattr(transformers, "DataCollatorWithFlattening"), reason="transformers without packing")
def test_a_packing_collator_is_refused_before_the_first_step(tmp_path):
    packing = transformers.DataCollatorWithFlattening()
    with pytest.raises(RowsPerExampleError, match=r"batch\['input_ids'\] has shape \(1, \d+\) for one example"):
        train(tmp_path, collator=lambda features: packing(without_index(features)))


def test_a_collator_with_two_rows_per_example_is_refused(tmp_path):
    with pytest.raises(RowsPerExampleError, match="one row per example"):
        train(tmp_path, collator=two_views)


def test_a_padding_collator_with_one_row_per_example_trains(tmp_path):
    trainer = train(tmp_path, collator=lambda features: torch.utils.data.default_collate(without_index(features)))
    assert trainer.state.global_step == 2 and trainer.privacy_engine.accountant.history[0][2] == 2


def test_label_smoothing_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 would not be applied.*per_example_loss"):
        DPTrainer(model=tiny_model(), args=training_args(tmp_path, label_smoothing_factor=0.1),
                  train_dataset=TokenBlocks(), privacy_args=PRIVACY)


def test_the_trainers_compute_loss_func_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func would not be called.*per_example_loss"):
        DPTrainer(model=tiny_model(), args=training_args(tmp_path), train_dataset=TokenBlocks(),
                  privacy_args=PRIVACY, compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0)

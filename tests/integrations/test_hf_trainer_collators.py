"""DPTrainer refuses what would break the per-example bound or be silently ignored: a data
collator that packs examples into one row or spreads one over several rows (the Poisson loader's
one-row-per-example check, ``opacus_dp/data/collate_rows.py``), ``label_smoothing_factor`` and the
Trainer's ``compute_loss_func`` (the private step trains on one loss per example), ``fp16`` (Accelerate's
GradScaler hides the loss scale from the private step), NEFTune; padded rows train as their examples alone."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opacus_dp.data.collate_rows import RowsPerExampleError  # noqa: E402
from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402
from tests.integrations.hf_trainer_support import (  # noqa: E402
    ACCUMULATION, LR, PHYSICAL, SEQ, VOCAB, TokenBlocks, tiny_llama, tiny_model, training_args)

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


def test_fp16_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="fp16=True.*bf16=True"):
        DPTrainer(model=tiny_model(), args=training_args(tmp_path, fp16=True), train_dataset=TokenBlocks(),
                  privacy_args=PRIVACY)


def test_a_grad_scaler_of_accelerate_is_refused_at_construction(tmp_path, monkeypatch):
    """Accelerate's GradScaler (fp16 on a GPU; on CPU set by hand) steps the private optimizer through
    a wrapper that hides the scaler: refused before training, not at the first step."""
    original = transformers.Trainer.create_accelerator_and_postprocess

    def with_scaler(self):
        original(self)
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", with_scaler)
    with pytest.raises(ValueError, match="fp16=True.*bf16=True"):
        train(tmp_path)


class Varied(torch.utils.data.Dataset):
    """Token rows of 2 to SEQ tokens."""

    def __init__(self, n=24):
        g = torch.Generator().manual_seed(5)
        lengths = torch.randint(2, SEQ + 1, (n,), generator=g)
        self.rows = [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "index": i}


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_train_as_the_examples_alone(tmp_path, side):
    """Padding (labels -100, attention_mask 0) adds nothing to a row's loss: with left padding the
    first token of a row shorter than another in its batch would be predicted from padding, tying its
    gradient to the other rows. Oracle: each example alone, the model's own loss, clipped by hand."""
    data, batches, armed, clip = Varied(), [], [], 0.05

    def pad(features):
        if armed:
            batches.append([f["index"] for f in features])
        n = max(len(f["input_ids"]) for f in features)
        ids, mask = torch.zeros(len(features), n, dtype=torch.long), torch.zeros(len(features), n, dtype=torch.long)
        for r, f in enumerate(features):
            k = len(f["input_ids"])
            at = slice(0, k) if side == "right" else slice(n - k, n)
            ids[r, at], mask[r, at] = f["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    arm = type("Arm", (transformers.TrainerCallback,), {"on_train_begin": lambda *a, **k: armed.append(1)})
    trainer = DPTrainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=4), train_dataset=data,
                        data_collator=pad, callbacks=[arm()], privacy_args=PrivacyArguments(
                            target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=clip))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert any(len({len(data.rows[i]) for i in b}) > 1 for b in batches), "no batch was padded"
    model = tiny_llama()
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in batches:
        total = [torch.zeros_like(p) for p in params]
        for i in batch:
            x = data.rows[i][None]
            grads = torch.autograd.grad(model(input_ids=x, labels=x).loss, params)
            factor = min(1.0, clip / (float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) + 1e-6))
            total = [t + factor * g for t, g in zip(total, grads)]
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= LR * t / (PHYSICAL * ACCUMULATION)
    for got, want in zip([p for p in trainer.model.parameters() if p.requires_grad], params):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_neftune_is_refused_at_construction(tmp_path):
    """NEFTune's noise is scaled by the batch's padded length, which the other examples set."""
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0.*padded length"):
        DPTrainer(model=tiny_model(), args=training_args(tmp_path, neftune_noise_alpha=5.0),
                  train_dataset=TokenBlocks(), privacy_args=PRIVACY)

"""``DPTrainer`` with the user's optimizer and scheduler (``Trainer(optimizers=(opt, sched))``) and
with ``TrainingArguments.optim`` choices (:mod:`opacus_dp.integrations.transformers_checks`).

Oracle: σ = 0 with clipping active, an autograd loop over single examples of each logical batch the
run drew gives ``Σ_i clip_C(∇ℓ_i) / L``, which a fresh optimizer of the same kind (torch's, or
transformers' Adafactor) applies at the learning rate the schedule gives for that step (computed by
hand). Each batch has several physical pieces, so a scheduler stepped per piece, or an update per
piece, would give other weights.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opacus_dp.engine.modern import PrivacyEngine  # noqa: E402
from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402
from tests.integrations.hf_trainer_support import (L, PHYSICAL, Recorder, TokenBlocks, tiny_model,  # noqa: E402
                                                   training_args)

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

CLIP, STEPS = 0.05, 4


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def gpt2():
    """The tiny GPT-2 with its attention's key bias frozen: its gradient is 0 in exact arithmetic (the
    softmax of a query's scores ignores a constant added to all of them), so in floats it is rounding
    noise, which Adam-like optimizers scale up to a step of ±lr in any direction."""
    model = tiny_model()
    model.transformer.h[0].attn.c_attn.bias.requires_grad_(False)
    return model


def private_run(out, model=None, optimizers=(None, None), **overrides):
    recorder = Recorder()
    trainer = DPTrainer(model=model or gpt2(), args=training_args(out, max_steps=STEPS, **overrides),
                        train_dataset=TokenBlocks(), data_collator=recorder, callbacks=[recorder],
                        optimizers=optimizers,
                        privacy_args=PrivacyArguments(target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=CLIP))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert len(recorder.batches) == STEPS and any(len(b) > PHYSICAL for b in recorder.batches)
    return trainer, recorder.batches


def oracle(batches, make_optimizer, lr_at):
    """Parameters after feeding each batch's clipped mean gradient to ``make_optimizer(params)``."""
    model, data = gpt2(), TokenBlocks()
    params = trainable(model)
    optimizer = make_optimizer(params)
    for k, batch in enumerate(batches):
        total = [torch.zeros_like(p) for p in params]
        for i in batch:
            x = data.ids[i][None]
            grads = torch.autograd.grad(model(input_ids=x, labels=x).loss, params)
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
            factor = min(1.0, CLIP / (float(norm) + 1e-6))
            total = [t + factor * g for t, g in zip(total, grads)]
        for p, t in zip(params, total):
            p.grad = t / L
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k)
        optimizer.step()
    return params


def assert_close_to(trainer, expected, atol):
    for got, want in zip(trainable(trainer.model), expected):
        torch.testing.assert_close(got.detach(), want.detach(), atol=atol, rtol=1e-4)
    assert not torch.equal(trainable(trainer.model)[0], trainable(gpt2())[0])


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_users_optimizer_and_scheduler_equal_per_sample_oracle(tmp_path, kind):
    lr, decay = (0.5, 0.5) if kind == "sgd_momentum" else (1e-3, 0.7)
    build = (lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)) if kind == "sgd_momentum" \
        else (lambda ps: torch.optim.Adam(ps, lr=lr))
    model = gpt2()
    optimizer = build(trainable(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: decay ** k)
    trainer, batches = private_run(tmp_path, model=model, optimizers=(optimizer, scheduler))
    assert trainer.lr_scheduler is scheduler and scheduler.last_epoch == STEPS  # once per logical batch
    assert trainer.optimizer.optimizer.original_optimizer is optimizer  # Accelerate's wrapper of the private one
    # Adam divides by sqrt(v): rounding in an element with a tiny gradient moves it by a fraction of lr
    atol = lr / 100 if kind == "adam" else 1e-6
    assert_close_to(trainer, oracle(batches, build, lambda k: lr * decay ** k), atol=atol)


@pytest.mark.parametrize("optim", ["adamw_torch", "adafactor"])
def test_optim_choices_equal_per_sample_oracle(tmp_path, optim):
    lr = 1e-3
    build = {"adamw_torch": lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
             "adafactor": lambda ps: transformers.optimization.Adafactor(ps, lr=lr, scale_parameter=False,
                                                                         relative_step=False)}[optim]
    trainer, batches = private_run(tmp_path, optim=optim, learning_rate=lr, lr_scheduler_type="linear")
    linear = lambda k: lr * (STEPS - k) / STEPS  # noqa: E731 - transformers' linear schedule, no warm-up
    assert_close_to(trainer, oracle(batches, build, linear), atol=lr / 100)


class WithModes(torch.optim.SGD):
    """An optimizer with train()/eval() modes, as the schedule-free ones."""

    def train(self):
        pass


@pytest.mark.parametrize("make, match", [
    (lambda m: object(), "must be a torch.optim.Optimizer"),
    (lambda m: WithModes(trainable(m), lr=0.1), "train\\(\\)/eval\\(\\)"),
    (lambda m: torch.optim.SGD(trainable(tiny_model()), lr=0.1), "not trainable parameters of the model"),
])
def test_optimizers_the_private_step_cannot_drive_are_refused_up_front(tmp_path, make, match):
    model = tiny_model()
    with pytest.raises((TypeError, ValueError), match=match):
        DPTrainer(model=model, args=training_args(tmp_path), train_dataset=TokenBlocks(),
                  optimizers=(make(model), None), privacy_args=PrivacyArguments(target_delta=1e-5,
                                                                                noise_multiplier=1.0))


def test_an_optimizer_made_private_already_is_refused(tmp_path):
    model = tiny_model()
    data = torch.utils.data.DataLoader(TokenBlocks(), batch_size=6)
    _, private, _ = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(trainable(model), lr=0.1),
                                                 data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="already private"):
        DPTrainer(model=model, args=training_args(tmp_path), train_dataset=TokenBlocks(), optimizers=(private, None),
                  privacy_args=PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0))


@pytest.mark.parametrize("optim", ["lomo", "adalomo", "galore_adamw_layerwise", "schedule_free_adamw"])
def test_optim_choices_that_update_in_backward_or_have_modes_are_refused(tmp_path, optim):
    with pytest.raises(ValueError, match=f"optim='{optim}'"):
        DPTrainer(model=tiny_model(), args=training_args(tmp_path, optim=optim), train_dataset=TokenBlocks(),
                  privacy_args=PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0))

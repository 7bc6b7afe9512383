"""Lightning runs resumed inside an epoch, and stopped at a privacy budget
(:mod:`opacus_dp.integrations.lightning`, :mod:`opacus_dp.integrations.lightning_loader`).

Oracles, independent of the code under test:

* resume: an uninterrupted run with the same seed (bitwise: batches, weights, history, ε). With
  ``num_workers > 0`` the workers draw batches ahead of training, so the sampler's state when the
  checkpoint is written is not the position (a resume from it would take other batches);
* budget: a fresh accountant replaying (σ, q) once per step gives ε after each step.
"""

import glob

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="the Lightning integration needs the 'lightning' package")

from opacus_dp.accountants import create_accountant  # noqa: E402
from opacus_dp.integrations.lightning import DPCallback, UnsupportedLightningSetupError  # noqa: E402
from opacus_dp.integrations.lightning_state import STATE_KEY  # noqa: E402
from tests.integrations.lightning_support import BATCH, N, Recorder, SaveAt, data, fit  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

Q = BATCH / N  # 4 steps per epoch
SIGMA = 1.0


def callback(**options):
    settings = dict(target_delta=1e-5, max_grad_norm=1.0, noise_multiplier=SIGMA, accountant="rdp")
    settings.update(options)
    return DPCallback(**settings)


def run(savers=(), ckpt_path=None, epochs=3, workers=0, module_options=None, trainer_options=None, **options):
    pl.seed_everything(0)
    module, dp = Recorder(*data(), num_workers=workers, **(module_options or {})), callback(**options)
    fit(module, [dp, *savers], ckpt_path=ckpt_path, epochs=epochs, enable_checkpointing=True,
        **(trainer_options or {}))
    return module, dp


def assert_continues(whole, whole_dp, resumed, resumed_dp, done: int):
    assert len(resumed.records) == len(whole.records) - done
    for (_, xa, ya), (_, xb, yb) in zip(whole.records[done:], resumed.records):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # the same Poisson batches
    for a, b in zip(whole.net.parameters(), resumed.net.parameters()):
        assert torch.equal(a, b)  # and the same noise
    assert resumed_dp.privacy_engine.accountant.history == whole_dp.privacy_engine.accountant.history
    assert resumed_dp.optimizer.steps_taken == whole_dp.optimizer.steps_taken == 12
    assert resumed_dp.get_epsilon() == whole_dp.get_epsilon()


# ---------------------------------------------------------------------------- resume inside an epoch
@pytest.mark.parametrize("workers", [0, 2])
def test_model_checkpoint_every_n_steps_resumes_mid_epoch_bitwise(tmp_path, workers):
    saver = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "whole"), save_top_k=-1, every_n_train_steps=3)
    whole, whole_dp = run([saver], workers=workers)
    for name, done in (("epoch=0-step=3.ckpt", 3), ("epoch=1-step=6.ckpt", 6)):  # batch 3 and 2 of 4
        saved = torch.load(tmp_path / "whole" / name, weights_only=True)
        assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == (done - 1) % 4 + 1
        resumed, resumed_dp = run(ckpt_path=str(tmp_path / "whole" / name), workers=workers)
        assert_continues(whole, whole_dp, resumed, resumed_dp, done)


@pytest.mark.parametrize("step", [4, 5])  # the last batch of epoch 0, the first of epoch 1
def test_save_checkpoint_in_a_callback_resumes_bitwise(tmp_path, step):
    whole, whole_dp = run([SaveAt(step, tmp_path / "saved.ckpt")], workers=2)
    resumed, resumed_dp = run(ckpt_path=str(tmp_path / "saved.ckpt"), workers=2)
    assert_continues(whole, whole_dp, resumed, resumed_dp, step)


def test_secure_mode_resumes_mid_epoch_with_exact_accounting(tmp_path):
    whole, whole_dp = run([SaveAt(5, tmp_path / "at5.ckpt")], secure_mode=True)
    resumed, resumed_dp = run(ckpt_path=str(tmp_path / "at5.ckpt"), secure_mode=True)
    assert len(resumed.records) == 7  # 3 batches left in epoch 1, then epoch 2
    assert resumed_dp.privacy_engine.accountant.history == whole_dp.privacy_engine.accountant.history


def test_a_loader_position_that_lightning_does_not_continue_is_refused(tmp_path):
    run([SaveAt(5, tmp_path / "at5.ckpt")])
    saved = torch.load(tmp_path / "at5.ckpt", weights_only=True)
    saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] = 0  # Lightning resumes at 1
    torch.save(saved, tmp_path / "moved.ckpt")
    with pytest.raises(UnsupportedLightningSetupError, match="handed out 1 batches"):
        run(ckpt_path=str(tmp_path / "moved.ckpt"))


def test_a_mid_epoch_checkpoint_with_another_batch_size_is_refused_at_load(tmp_path):
    run([SaveAt(5, tmp_path / "at5.ckpt")])
    with pytest.raises(ValueError, match="4 batches per epoch, this loader has 8"):
        run(ckpt_path=str(tmp_path / "at5.ckpt"), module_options=dict(batch_size=BATCH // 2))


# ---------------------------------------------------------------------------- budget stop
def replayed_epsilons(steps: int):
    replay, epsilons = create_accountant("rdp"), []
    for _ in range(steps):
        replay.step(noise_multiplier=SIGMA, sample_rate=Q)
        epsilons.append(replay.get_epsilon(1e-5))
    return epsilons


class Watch(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append(float(trainer.callback_metrics["epsilon"]))


def test_training_stops_before_the_step_that_exceeds_max_epsilon(tmp_path):
    epsilons = replayed_epsilons(4)
    budget = (epsilons[2] + epsilons[3]) / 2  # 3 steps fit, the 4th would not
    watch = Watch()
    saver = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_train_steps=1)
    module, dp = run([watch, saver], epochs=2, max_epsilon=budget)
    assert len(module.records) == dp.optimizer.steps_taken == 3
    assert watch.seen == pytest.approx(epsilons[:3], rel=1e-6)  # logged as float32
    assert dp.get_epsilon() == pytest.approx(epsilons[2], rel=1e-12) and dp.get_epsilon() <= budget
    last = torch.load(sorted(glob.glob(str(tmp_path / "*.ckpt")))[-1], weights_only=True)
    assert last["global_step"] == 3 and last[STATE_KEY]["dp_optimizer_steps"] == 3
    assert last[STATE_KEY]["privacy_accountant_state_dict"]["history"] == [(SIGMA, Q, 3)]
    for name, p in module.named_parameters():
        assert torch.equal(last["state_dict"][name], p.detach())
    # resumed with the same budget: not one more step
    again, again_dp = run(ckpt_path=sorted(glob.glob(str(tmp_path / "*.ckpt")))[-1], epochs=2, max_epsilon=budget)
    assert again.records == [] and again_dp.get_epsilon() == dp.get_epsilon() <= budget


def test_the_step_that_stops_at_the_budget_logs_epsilon_whatever_the_logging_interval():
    epsilons = replayed_epsilons(4)
    seen = []

    class Latest(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            value = trainer.callback_metrics.get("epsilon")
            seen.append(None if value is None else float(value))

    module, dp = run([Latest()], epochs=2, max_epsilon=(epsilons[2] + epsilons[3]) / 2, log_epsilon_every_n_steps=100)
    assert seen[:2] == [None, None] and seen[2] == pytest.approx(epsilons[2], rel=1e-6) and len(seen) == 3


def test_a_budget_below_one_step_trains_nothing():
    module, dp = run(epochs=1, max_epsilon=replayed_epsilons(1)[0] * 0.99)
    assert module.records == [] and dp.get_epsilon() == 0.0


def test_target_epsilon_is_the_default_budget():
    dp = callback(noise_multiplier=None, target_epsilon=2.0, epochs=1)
    assert dp.max_epsilon == 2.0 and dp.privacy_engine.max_epsilon == 2.0
    assert callback().max_epsilon is None


def test_min_steps_with_a_budget_is_refused():
    with pytest.raises(UnsupportedLightningSetupError, match="min_epochs or min_steps"):
        run(epochs=2, max_epsilon=5.0, trainer_options=dict(min_steps=6))
    with pytest.raises(ValueError, match="max_epsilon must be a finite number"):
        callback(max_epsilon=float("inf"))

"""DP training with PyTorch Lightning: :mod:`opacus_dp.integrations.lightning`.

Oracles, all independent of the code under test:

* σ = 0, small C: each step's update equals ``lr · Σ_i clip_C(∇ℓ_i) / (q·N)`` computed by an autograd
  loop over the examples of the batch the run drew (both ranks' batches under DDP);
* ε: a fresh accountant replaying (σ, q = B/N) once per step;
* resume: an uninterrupted run with the same seed (bitwise).
"""

import glob
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="the Lightning integration needs the 'lightning' package")

from opacus_dp.accountants import create_accountant  # noqa: E402
from opacus_dp.checkpoints.file_format import CheckpointIntegrityError  # noqa: E402
from opacus_dp.integrations.lightning import (DPCallback, PrivateDataLoader,  # noqa: E402
                                              UnsupportedLightningSetupError)
from opacus_dp.integrations.lightning_state import STATE_KEY  # noqa: E402
from tests.distributed.spawn import run_on_ranks  # noqa: E402
from tests.integrations.lightning_support import (BATCH, LR, N, Recorder, clipped_sum, data,  # noqa: E402
                                                  ddp_worker, fit)

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

BOUND = 0.05  # small enough that every example is clipped
Q = BATCH / N  # 1/len(DataLoader(..., batch_size=BATCH))


def callback(**options):
    settings = dict(target_delta=1e-5, max_grad_norm=BOUND, noise_multiplier=0.0, accountant="rdp")
    settings.update(options)
    return DPCallback(**settings)


def assert_updates_match_oracle(steps, final, expected_batch: float):
    """``steps``: per step, the parameters before it and the batches (x, y) of every rank."""
    after = [s[0] for s in steps[1:]] + [final]
    for k, ((before, batches), result) in enumerate(zip(steps, after)):
        total = None
        for x, y in batches:
            part = clipped_sum(before, x, y, BOUND)
            total = part if total is None else [a + b for a, b in zip(total, part)]
        for p0, s, p1 in zip(before, total, result):
            expected = p0.double() - LR * s / expected_batch
            torch.testing.assert_close(p1.double(), expected, rtol=0, atol=1e-6, msg=f"step {k}")


def test_clipped_steps_match_per_example_oracle():
    pl.seed_everything(0)
    module = Recorder(*data())
    fit(module, [callback()])
    assert len(module.records) == 2 * round(1 / Q)
    assert sum(len(y) for _, _, y in module.records) != len(module.records) * BATCH  # Poisson sizes vary
    steps = [(params, [(x, y)]) for params, x, y in module.records]
    assert_updates_match_oracle(steps, [p.detach() for p in module.net.parameters()], Q * N)
    # after fitting the module is a plain module again: no per-sample hooks left on its layers
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


class CallsItsForward(Recorder):
    """Its ``training_step`` calls its ``forward``, the code ``torch.compile(module)`` compiles."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.records.append(([p.detach().clone() for p in self.net.parameters()], x.clone(), y.clone()))
        return torch.nn.functional.cross_entropy(self(x), y)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("mode", ["bk", "hooks"])
@pytest.mark.parametrize("module_class", [CallsItsForward, Recorder])
def test_a_compiled_module_traces_its_layers_and_matches_the_oracle(monkeypatch, module_class, mode):
    """``trainer.fit(torch.compile(module))``: Lightning compiles ``training_step``. The first step
    runs eagerly and learns the hooked calls (and checks the samples, whose hooks then leave the
    modules); every later step has both ``Linear`` calls tapped into the graphs, dynamo breaks none,
    and the clipped steps are the oracle's. (The module's own record list, longer at each step,
    makes dynamo compile ``training_step`` once per step here.)"""
    from torch._dynamo.utils import counters

    from tests.compile.helpers import count_tapped_calls

    tapped = count_tapped_calls(monkeypatch)
    pl.seed_everything(0)
    module = module_class(*data())
    torch._dynamo.reset()
    counters.clear()
    fit(torch.compile(module, backend="eager"), [callback(grad_sample_mode=mode)])
    steps = [(params, [(x, y)]) for params, x, y in module.records]
    assert len(steps) == 2 * round(1 / Q)
    assert tapped == [2] * (len(steps) - 1)
    assert sum(counters["graph_break"].values()) == 0, list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert_updates_match_oracle(steps, [p.detach() for p in module.net.parameters()], Q * N)


class NamedExamples(CallsItsForward):
    """Batches of dictionaries with each example's name (a list of strings) beside its tensors."""

    def training_step(self, batch, batch_idx):
        assert len(batch["name"]) == len(batch["y"])
        return super().training_step((batch["x"], batch["y"]), batch_idx)

    def train_dataloader(self):
        examples = [{"x": self.x[i], "y": self.y[i], "name": f"example {i}"} for i in range(len(self.x))]
        return PrivateDataLoader(torch.utils.data.DataLoader(examples, batch_size=self.batch_size))


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_step_on_batches_with_strings_learns_once(monkeypatch):
    """The batch's signature is that of its tensors: the examples' names, other in every batch, do
    not make each step learn its calls again."""
    from tests.compile.helpers import count_tapped_calls

    tapped = count_tapped_calls(monkeypatch)
    pl.seed_everything(0)
    module = NamedExamples(*data())
    fit(torch.compile(module, backend="eager"), [callback()])
    steps = [(params, [(x, y)]) for params, x, y in module.records]
    assert tapped == [2] * (len(steps) - 1)
    assert_updates_match_oracle(steps, [p.detach() for p in module.net.parameters()], Q * N)


class FailsAtStep(CallsItsForward):
    def __init__(self, *args, fail_at: int):
        super().__init__(*args)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("training_step failed")
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_failing_compiled_step_gives_the_compiler_its_stance_back(fail_at):
    """The first step runs eagerly (``force_eager``) to learn the hooked calls; a step failing then,
    or later, leaves the compiler as it was: a function compiled afterwards is compiled."""
    from tests.compile.helpers import recording_backend

    pl.seed_everything(0)
    with pytest.raises(RuntimeError, match="training_step failed"):
        fit(torch.compile(FailsAtStep(*data(), fail_at=fail_at), backend="eager"), [callback()])
    graphs, backend = recording_backend()
    try:
        assert torch.compile(lambda t: t * 2 + 1, backend=backend)(torch.ones(3)).sum() == 9
        assert len(graphs) == 1
    finally:
        torch.compiler.set_stance("default")  # for the tests after a failure here


def test_logged_epsilon_equals_accountant_replay():
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(float(trainer.callback_metrics["epsilon"]))

    pl.seed_everything(0)
    dp = callback(noise_multiplier=1.3)
    fit(Recorder(*data()), [dp, Watch()])
    replay = create_accountant("rdp")
    expected = []
    for _ in range(2 * round(1 / Q)):
        replay.step(noise_multiplier=1.3, sample_rate=Q)
        expected.append(replay.get_epsilon(1e-5))
    assert seen == pytest.approx(expected, rel=1e-6)
    assert dp.get_epsilon() == pytest.approx(expected[-1], rel=1e-12)


def test_epsilon_every_n_steps_is_logged_at_those_steps_and_the_last_of_each_epoch():
    """``log_epsilon_every_n_steps=3`` over 2 epochs of 4 steps: ε is logged after steps 3, 4
    (an epoch's last), 6 and 8 (the run's last), each time the replayed ε of that step; between,
    the last logged value stays."""
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            value = trainer.callback_metrics.get("epsilon")
            seen.append(None if value is None else float(value))

    pl.seed_everything(0)
    fit(Recorder(*data()), [callback(noise_multiplier=1.3, log_epsilon_every_n_steps=3), Watch()])
    replay, expected, latest = create_accountant("rdp"), [], None
    for step in range(1, 2 * round(1 / Q) + 1):
        replay.step(noise_multiplier=1.3, sample_rate=Q)
        if step in (3, 4, 6, 8):
            latest = replay.get_epsilon(1e-5)
        expected.append(latest)
    assert seen[:2] == [None, None]
    assert seen[2:] == pytest.approx(expected[2:], rel=1e-6)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, None])
def test_log_epsilon_every_n_steps_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="log_epsilon_every_n_steps"):
        callback(log_epsilon_every_n_steps=bad)


def test_target_epsilon_calibrates_sigma_within_budget():
    pl.seed_everything(0)
    dp = callback(noise_multiplier=None, target_epsilon=3.0, epochs=2)
    fit(Recorder(*data()), [dp])
    replay = create_accountant("rdp")
    for _ in range(2 * round(1 / Q)):
        replay.step(noise_multiplier=dp.optimizer.noise_multiplier, sample_rate=Q)
    assert 2.5 < replay.get_epsilon(1e-5) <= 3.0
    assert dp.get_epsilon() == pytest.approx(replay.get_epsilon(1e-5), rel=1e-9)


def _checkpointed_run(directory, epochs, ckpt_path=None):
    pl.seed_everything(0)
    module, dp = Recorder(*data()), callback(noise_multiplier=1.0, max_grad_norm=1.0)
    saver = pl.callbacks.ModelCheckpoint(dirpath=str(directory), save_top_k=-1, every_n_epochs=1)
    fit(module, [dp, saver], ckpt_path=ckpt_path, epochs=epochs, enable_checkpointing=True)
    return module, dp


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    whole, whole_dp = _checkpointed_run(tmp_path / "whole", epochs=3)
    first = sorted(glob.glob(str(tmp_path / "whole" / "epoch=0-*.ckpt")))[0]
    resumed, resumed_dp = _checkpointed_run(tmp_path / "resumed", epochs=3, ckpt_path=first)
    assert len(resumed.records) == 2 * round(1 / Q)
    for (pa, xa, ya), (pb, xb, yb) in zip(whole.records[round(1 / Q):], resumed.records):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # the same Poisson batches
    for a, b in zip(whole.net.parameters(), resumed.net.parameters()):
        assert torch.equal(a, b)  # the same noise too
    assert resumed_dp.privacy_engine.accountant.history == whole_dp.privacy_engine.accountant.history
    assert resumed_dp.optimizer.steps_taken == whole_dp.optimizer.steps_taken
    assert resumed_dp.get_epsilon() == whole_dp.get_epsilon()


def test_checkpoint_without_or_with_shortened_private_state_is_refused(tmp_path):
    _checkpointed_run(tmp_path / "run", epochs=1)
    path = glob.glob(str(tmp_path / "run" / "*.ckpt"))[0]
    saved = torch.load(path, weights_only=True)
    bare = {k: v for k, v in saved.items() if k != STATE_KEY}
    torch.save(bare, tmp_path / "bare.ckpt")
    with pytest.raises(ValueError, match="count epsilon from zero"):
        _checkpointed_run(tmp_path / "again", epochs=2, ckpt_path=str(tmp_path / "bare.ckpt"))
    shortened = dict(saved)
    state = dict(saved[STATE_KEY])
    accountant = dict(state["privacy_accountant_state_dict"])
    accountant["history"] = [(1.0, Q, 1)]  # 4 steps released, 1 recorded: ε would be under-reported
    shortened[STATE_KEY] = {**state, "privacy_accountant_state_dict": accountant}
    torch.save(shortened, tmp_path / "short.ckpt")
    with pytest.raises(CheckpointIntegrityError):
        _checkpointed_run(tmp_path / "again2", epochs=2, ckpt_path=str(tmp_path / "short.ckpt"))


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("setup, options, message", [
    (dict(private_loader=False), {}, "not a PrivateDataLoader"),
    (dict(optimizers=2, manual=True), {}, "2 optimizers"),
    (dict(optimizers=0), {}, "0 optimizers|one torch.optim.Optimizer"),
    ({}, dict(accumulate_grad_batches=2), "accumulate_grad_batches=2"),
    ({}, dict(gradient_clip_val=1.0), "gradient_clip_val"),
    ({}, dict(reload_dataloaders_every_n_epochs=1), "reload_dataloaders_every_n_epochs=1"),
])
def test_unsupported_setups_are_refused(setup, options, message):
    with pytest.raises(UnsupportedLightningSetupError, match=message):
        fit(Recorder(*data(), **setup), [callback()], **options)


def test_a_gradient_accumulation_scheduler_is_refused_before_the_first_step():
    private = callback()
    with pytest.raises(UnsupportedLightningSetupError, match="GradientAccumulationScheduler"):
        fit(Recorder(*data()), [private, pl.callbacks.GradientAccumulationScheduler({1: 2})], max_epochs=2)
    assert private.privacy_engine is None or len(private.privacy_engine.accountant) == 0


class SkipsSecondBatch(Recorder):
    """Returns None (Lightning's "skip this batch") from the second training_step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


@pytest.mark.parametrize("scaled", [False, True])
def test_a_skipped_batch_is_refused_at_its_step(scaled):
    """A batch skipped by its data would be an unaccounted, data-dependent release: refused when
    it reaches its step (float32, and float16 with Lightning's GradScaler), after one trained step."""
    from lightning.pytorch.plugins import MixedPrecision
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))] if scaled else []
    private, module = callback(), SkipsSecondBatch(*data())
    with pytest.raises(UnsupportedLightningSetupError, match="training_step returned None"):
        fit(module, [private], plugins=plugins)
    assert len(module.records) == 2 and private.privacy_engine.accountant.history == [(0.0, Q, 1)]


def test_bad_arguments_are_refused():
    with pytest.raises(UnsupportedLightningSetupError, match="noise_mechanism='tree'"):
        callback(noise_mechanism="tree")
    with pytest.raises(UnsupportedLightningSetupError, match="grad_sample_mode='ghost'"):
        callback(grad_sample_mode="ghost")
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        callback(target_epsilon=1.0, epochs=1)
    with pytest.raises(ValueError, match="needs epochs"):
        callback(noise_multiplier=None, target_epsilon=1.0)
    with pytest.raises(ValueError, match="target_delta"):
        callback(target_delta=0)
    with pytest.raises(TypeError, match="DataLoader"):
        PrivateDataLoader([1, 2, 3])


def test_private_loader_without_callback_refuses_to_train():
    with pytest.raises(RuntimeError, match="DPCallback"):
        fit(Recorder(*data()), [])


# ---------------------------------------------------------------------------- 2 processes (DDP)
@pytest.mark.distributed
def test_ddp_two_processes_match_oracle_and_agree_on_epsilon():
    ranks = run_on_ranks(ddp_worker, 2, BOUND, 1.1, timeout=28.0)
    clipped = [r["clipped"] for r in ranks]
    batches = [[(x, y) for _, x, y in r["records"]] for r in clipped]
    assert len(batches[0]) == len(batches[1]) == round(1 / Q)
    for (xa, _), (xb, _) in zip(*batches):  # each rank its own part of one global sample
        assert not any(bool((xa[i] == xb).all(dim=1).any()) for i in range(len(xa)))
    steps = [(clipped[0]["records"][k][0], [batches[0][k], batches[1][k]]) for k in range(len(batches[0]))]
    assert_updates_match_oracle(steps, clipped[0]["final"], Q * N)
    for a, b in zip(clipped[0]["final"], clipped[1]["final"]):
        assert torch.equal(a, b)
    noised = [r["noised"] for r in ranks]
    assert noised[0]["epsilon"] == noised[1]["epsilon"]
    for a, b in zip(noised[0]["final"], noised[1]["final"]):
        assert torch.equal(a, b)  # the noise is added once and shared
    replay = create_accountant("rdp")
    for _ in range(round(1 / Q)):
        replay.step(noise_multiplier=1.1, sample_rate=Q)
    assert noised[0]["epsilon"] == pytest.approx(replay.get_epsilon(1e-5), rel=1e-6)
    assert os.environ.get("RANK") is None  # the workers' settings stayed in their processes


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_ddp_two_processes_compiled_trace_the_layers_and_match_the_oracle():
    ranks = run_on_ranks(ddp_worker, 2, BOUND, 0.0, True, timeout=60.0)
    clipped = [r["clipped"] for r in ranks]
    batches = [[(x, y) for _, x, y in r["records"]] for r in clipped]
    steps = [(clipped[0]["records"][k][0], [batches[0][k], batches[1][k]]) for k in range(len(batches[0]))]
    assert len(steps) == round(1 / Q)
    assert_updates_match_oracle(steps, clipped[0]["final"], Q * N)
    for rank in ranks:
        assert rank["tapped"] == [2] * (len(steps) - 1) and rank["breaks"] == 0


# ---------------------------------------------------------------------------- the example
@pytest.mark.slow
def test_example_reaches_85_percent_at_epsilon_3(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
    from tests.examples.example_runs import read_json, run_example

    out = run_example("lightning_digits", ["--json", tmp_path / "summary.json"], capsys)
    summary = read_json(tmp_path / "summary.json")
    assert summary["test_accuracy"] >= 0.85, out
    # batch 512 over 1,437 examples: 3 steps per epoch (q = 1/3), 20 epochs
    assert summary["steps"] == 60
    replay = create_accountant("prv")
    for _ in range(60):
        replay.step(noise_multiplier=summary["noise_multiplier"], sample_rate=1 / 3)
    assert summary["epsilon"] == pytest.approx(replay.get_epsilon(1e-5), rel=1e-6)
    assert summary["epsilon"] <= 3.0
    assert f"ε = {summary['epsilon']:.2f}" in out

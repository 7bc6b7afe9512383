"""DP training through the Hugging Face ``Trainer``: :mod:`opacus_dp.integrations.transformers`.

Oracles, all independent of the code under test:

* σ = 0, C = ∞: a plain ``transformers.Trainer`` fed the logical batches the private run drew,
  with the loss ``Σ_i ℓ_i / L`` (``ℓ_i``: the model's own loss of example ``i`` alone);
* σ = 0, small C: an autograd loop over single examples, clipped by hand;
* ε: a fresh accountant replaying (σ, q = L/N) once per step;
* resume: an uninterrupted run with the same seeds.
"""

import math
import os
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opacus_dp.accountants import create_accountant  # noqa: E402
from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402
from opacus_dp.integrations.transformers_batches import pieces  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

from tests.integrations.hf_trainer_support import (  # noqa: E402
    ACCUMULATION, LR, PHYSICAL, L, N, Recorder, TokenBlocks, record_output_dtypes, tiny_llama, tiny_model, training_args)

def private_run(out, privacy, model=None, resume=None, **overrides):
    recorder = Recorder()
    trainer = DPTrainer(model=model or tiny_model(), args=training_args(out, **overrides), train_dataset=TokenBlocks(),
                        data_collator=recorder, callbacks=[recorder], privacy_args=privacy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder.batches


def example_loss(model, i, data):
    x = data.ids[i][None]
    return model(input_ids=x, labels=x).loss  # the model's own mean next-token loss of example i


def params_of(model):
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------------------- equivalences
class ReplayTrainer(transformers.Trainer):
    """Plain Trainer over given index batches with loss Σ_i ℓ_i / L."""

    def __init__(self, *a, batches, **kw):
        super().__init__(*a, **kw)
        self.batches = batches

    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(N)), batch_sampler=self.batches,
                                           collate_fn=lambda idx: {"index": torch.tensor(idx)})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return sum(example_loss(model, int(i), self.train_dataset) for i in inputs["index"]) / L


def test_no_noise_no_clipping_equals_plain_trainer(tmp_path):
    trainer, batches = private_run(tmp_path / "dp", PrivacyArguments(
        target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=float("inf")))
    assert len(batches) == trainer.state.global_step == 4
    assert any(len(b) > PHYSICAL for b in batches), "no batch was cut into several pieces"
    plain = ReplayTrainer(model=tiny_model(), args=training_args(tmp_path / "plain", gradient_accumulation_steps=1,
                                                                 max_grad_norm=0.0),
                          train_dataset=TokenBlocks(), batches=batches)
    plain.train()
    for got, want in zip(params_of(trainer.model), params_of(plain.model)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.equal(params_of(trainer.model)[0], params_of(tiny_model())[0])


@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
@pytest.mark.parametrize("physical, accumulation, steps", [(PHYSICAL, ACCUMULATION, 4), (1, 1, 12)])
def test_no_noise_with_clipping_equals_per_sample_oracle(tmp_path, mode, physical, accumulation, steps):
    """With one expected example per step some Poisson batches are empty: their steps add no
    gradient but are taken and accounted."""
    clip = 0.05
    trainer, batches = private_run(tmp_path, PrivacyArguments(
        target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=clip, grad_sample_mode=mode),
        per_device_train_batch_size=physical, gradient_accumulation_steps=accumulation, max_steps=steps)
    assert trainer.state.global_step == steps
    assert sum(n for _, _, n in trainer.privacy_engine.accountant.history) == steps
    if physical * accumulation == 1:
        assert len(batches) < steps, "no empty batch was drawn (the collator sees only non-empty ones)"
    assert_per_sample_oracle(trainer.model, batches, clip, physical * accumulation)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_torch_compile_equals_per_sample_oracle(tmp_path):
    """``torch_compile=True``: the private step and the causal-LM loss (labels shifted) are those
    of eager training (GPT-2)."""
    clip = 0.05
    trainer, batches = private_run(tmp_path, PrivacyArguments(
        target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=clip), torch_compile=True,
        torch_compile_backend="eager")
    assert_per_sample_oracle(trainer.model, batches, clip, L)


# Hooked calls of one forward: Llama's embedding, 4 attention and 3 MLP projections, 3 RMS norms and
# head; GPT-2's token and position embeddings, 4 projections (Conv1D), 3 LayerNorms and head.
HOOKED_CALLS = {"llama": (tiny_llama, 12), "gpt2": (tiny_model, 10)}


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("mode, backend, model_name", [("bk", "eager", "llama"), ("ghost", "aot_eager", "llama"),
                                                       ("bk", "aot_eager", "gpt2")])
def test_torch_compile_traces_the_hooked_layers_into_the_model_graphs(tmp_path, monkeypatch, mode, backend,
                                                                      model_name):
    """The training forwards are the private model's, compiled (``private.compile()`` with the
    Trainer's settings): every hooked call is tapped into the model's graphs (GPT-2's position
    embedding, called on one row broadcast over the batch, too), dynamo builds as many graphs over
    the pieces of changing sizes as for the model without privacy, without a graph break, and the
    step is the per-example oracle's (``ghost`` under AOT autograd: one book-keeping pass)."""
    from torch._dynamo.utils import counters

    from tests.compile.helpers import count_tapped_calls, recording_backend

    recording_backend()  # clears dynamo's caches and counters
    tapped = count_tapped_calls(monkeypatch)
    build, hooked = HOOKED_CALLS[model_name]
    clip = 0.05
    trainer, batches = private_run(tmp_path, PrivacyArguments(
        target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=clip, grad_sample_mode=mode), model=build(),
        torch_compile=True, torch_compile_backend=backend)
    private_graphs = counters["stats"]["unique_graphs"]
    assert sum(counters["graph_break"].values()) == 0
    empty = trainer.state.global_step - len(batches)  # each: one placeholder row
    pieces_run = [p["input_ids"] for b in batches + [[0]] * empty
                  for p in pieces({"input_ids": TokenBlocks().ids[b]}, PHYSICAL)]
    assert len({len(p) for p in pieces_run}) > 2, "the pieces' sizes did not change"
    assert len(tapped) == len(pieces_run) - 1 and set(tapped) == {hooked}  # the first piece learns the calls
    graphs, backend = recording_backend()
    plain = torch.compile(build(), backend=backend)
    for ids in pieces_run:
        plain(input_ids=ids).logits.sum().backward()
    assert private_graphs == len(graphs)
    assert_per_sample_oracle(trainer.model, batches, clip, L, build=build)


def assert_per_sample_oracle(trained, batches, clip: float, logical: int, build=tiny_model) -> None:
    """``trained``'s parameters are those of SGD over ``batches`` with each example's gradient
    (its own loss, autograd) clipped to ``clip`` by hand, the sum divided by ``logical``; ``build``
    makes the model ``trained`` started as."""
    model, data = build(), TokenBlocks()
    params = [p for p in model.parameters() if p.requires_grad]
    clipped_any = False
    for batch in batches:
        total = [torch.zeros_like(p) for p in params]
        for i in batch:
            grads = torch.autograd.grad(example_loss(model, i, data), params)
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
            factor = min(1.0, clip / (float(norm) + 1e-6))
            clipped_any |= factor < 1
            total = [t + factor * g for t, g in zip(total, grads)]
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= LR * t / logical
    assert clipped_any
    for got, want in zip(params_of(trained), params_of(model)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_epsilon_in_logs_equals_accountant_replay(tmp_path):
    sigma, delta = 1.3, 1e-5
    trainer, _ = private_run(tmp_path, PrivacyArguments(target_delta=delta, noise_multiplier=sigma, accountant="rdp"),
                             logging_steps=2)
    logged = [(entry["step"], entry["epsilon"]) for entry in trainer.state.log_history if "loss" in entry]
    assert [step for step, _ in logged] == [2, 4]
    for step, epsilon in logged:
        replay = create_accountant("rdp")
        for _ in range(step):
            replay.step(noise_multiplier=sigma, sample_rate=L / N)
        assert epsilon == pytest.approx(replay.get_epsilon(delta), rel=1e-9)


def test_training_stops_before_the_budget_is_exceeded(tmp_path):
    sigma, delta = 1.0, 1e-5
    replay = create_accountant("prv")
    epsilons = []
    for _ in range(5):
        replay.step(noise_multiplier=sigma, sample_rate=L / N)
        epsilons.append(replay.get_epsilon(delta))
    budget = (epsilons[2] + epsilons[3]) / 2  # 3 steps fit, the 4th would not
    trainer, _ = private_run(tmp_path, PrivacyArguments(target_delta=delta, noise_multiplier=sigma,
                                                        max_epsilon=budget), max_steps=10)
    assert trainer.state.global_step == 3
    assert trainer.get_epsilon() <= budget
    assert trainer.state.log_history[-2]["epsilon"] == pytest.approx(epsilons[2], rel=1e-6)


def test_target_epsilon_calibrates_for_the_planned_steps(tmp_path):
    trainer, _ = private_run(tmp_path, PrivacyArguments(target_delta=1e-5, target_epsilon=3.0), max_steps=6)
    assert trainer.state.global_step == 6
    epsilon = trainer.get_epsilon()
    assert 3.0 * 0.97 <= epsilon <= 3.0  # calibrated to spend (nearly) all of it, never more


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, workers):
    """With worker processes the loader draws ahead of training; the checkpoint still holds the
    sampling state after the last batch trained on (the collator, which records the batches,
    then runs in the workers: the weights and the history are compared)."""
    privacy = PrivacyArguments(target_delta=1e-5, noise_multiplier=0.8, max_grad_norm=0.1)
    full, full_batches = private_run(tmp_path / "full", privacy, max_steps=8, save_strategy="steps", save_steps=3,
                                     dataloader_num_workers=workers)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "private_state.pt").is_file()
    resumed, resumed_batches = private_run(tmp_path / "resumed", privacy, model=tiny_model(seed=5),
                                           resume=str(checkpoint), max_steps=8, dataloader_num_workers=workers)
    if not workers:
        assert resumed_batches == full_batches[3:]  # 5 steps per epoch: the resumed part crosses an epoch
    for got, want in zip(params_of(resumed.model), params_of(full.model)):
        assert torch.equal(got, want)
    assert resumed.privacy_engine.accountant.history == full.privacy_engine.accountant.history
    assert resumed.get_epsilon() == full.get_epsilon()


def test_resume_without_private_state_is_refused(tmp_path):
    privacy = PrivacyArguments(target_delta=1e-5, noise_multiplier=0.8)
    private_run(tmp_path / "run", privacy, max_steps=2, save_strategy="steps", save_steps=2)
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "run" / "checkpoint-2", damaged)
    os.remove(damaged / "private_state.pt")
    with pytest.raises(FileNotFoundError, match="private_state.pt"):
        private_run(tmp_path / "again", privacy, resume=str(damaged))


# ---------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, match", [
    (dict(target_delta=1e-5), "exactly one of noise_multiplier"),
    (dict(target_delta=1e-5, noise_multiplier=1.0, target_epsilon=2.0), "exactly one of noise_multiplier"),
    (dict(target_delta=0.0, noise_multiplier=1.0), "target_delta"),
    (dict(target_delta=1e-5, target_epsilon=-1.0), "target_epsilon"),
    (dict(target_delta=1e-5, noise_multiplier=1.0, secure_mode=True, seed=3), "seed"),
])
def test_bad_privacy_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyArguments(**kwargs)


def test_missing_privacy_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="privacy_args"):
        DPTrainer(model=tiny_model(), args=training_args(tmp_path), train_dataset=TokenBlocks())


# ---------------------------------------------------------------------------- LoRA, bf16
def test_lora_adapters_equal_per_sample_oracle(tmp_path):
    peft = pytest.importorskip("peft")

    def lora_model():
        config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                                 fan_in_fan_out=True, task_type="CAUSAL_LM")
        model = peft.get_peft_model(tiny_model(), config)
        torch.manual_seed(3)
        with torch.no_grad():  # LoRA's B starts at 0; make both factors matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return model

    clip = 0.02
    trainer, batches = private_run(tmp_path, PrivacyArguments(
        target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=clip), model=lora_model(), max_steps=3)
    model, data = lora_model(), TokenBlocks()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(params) < len(list(model.parameters()))
    for batch in batches:
        total = [torch.zeros_like(p) for p in params]
        for i in batch:
            grads = torch.autograd.grad(example_loss(model, i, data), params)
            factor = min(1.0, clip / (float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) + 1e-6))
            total = [t + factor * g for t, g in zip(total, grads)]
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= LR * t / L
    for got, want in zip(params_of(trainer.model), params_of(model)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    for name, p in trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[name]), name


def test_bf16_autocast_trains_close_to_float32(tmp_path):
    privacy = PrivacyArguments(target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=0.05)
    exact, _ = private_run(tmp_path / "fp32", privacy, max_steps=3)
    model = tiny_model()
    dtypes = record_output_dtypes(model)
    mixed, _ = private_run(tmp_path / "bf16", privacy, model=model, max_steps=3, bf16=True)
    assert dtypes and set(dtypes) == {torch.bfloat16}  # the training forwards ran under autocast
    start = params_of(tiny_model())
    for got, want, before in zip(params_of(mixed.model), params_of(exact.model), start):
        assert got.dtype == torch.float32
        moved = (want - before).norm()
        assert (got - want).norm() <= 0.05 * moved + 1e-6  # bf16 forward: a few per cent of the update


# ---------------------------------------------------------------------------- 2 gloo processes
@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_processes_equal_one_process_on_the_union_of_their_batches(tmp_path):
    from tests.distributed.spawn import run_on_ranks
    from tests.integrations.hf_trainer_support import train_on_rank

    clip, steps, world = 0.05, 3, 2
    ranks = run_on_ranks(train_on_rank, world, str(tmp_path), steps, clip, timeout=240)
    assert [r["world"] for r in ranks] == [world] * world
    assert all(r["steps"] == steps and len(r["batches"]) == steps for r in ranks)
    assert all(r["history"] == [(0.0, world * L / N, steps)] for r in ranks)  # q = 2 · L / N
    for step in range(steps):  # different data on each rank
        assert not set(ranks[0]["batches"][step]) & set(ranks[1]["batches"][step])
    expected, start = union_oracle(ranks, clip)
    for rank in ranks:
        assert rank["dtypes"] == ["torch.float32"] and rank["graphs"] == 0
        for got, want in zip(rank["params"], expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_two_processes_train_under_bf16_autocast_and_compiled(tmp_path):
    """Under DPDDP Accelerate does not prepare the model: the training forwards still run under
    the Trainer's autocast (``bf16=True``) and compiled (``torch_compile=True``)."""
    from tests.distributed.spawn import run_on_ranks
    from tests.integrations.hf_trainer_support import train_on_rank

    clip, steps, world = 0.05, 3, 2
    overrides = dict(bf16=True, torch_compile=True, torch_compile_backend="eager")
    ranks = run_on_ranks(train_on_rank, world, str(tmp_path), steps, clip, overrides, timeout=240)
    assert all(r["steps"] == steps and len(r["batches"]) == steps for r in ranks)
    expected, start = union_oracle(ranks, clip)
    for rank in ranks:
        assert rank["dtypes"] == ["torch.bfloat16"] and rank["graphs"] > 0
        for got, want, before in zip(rank["params"], expected, start):
            assert got.dtype == torch.float32
            assert (got - want).norm() <= 0.05 * (want - before).norm() + 1e-6  # bf16 forward: a few per cent


def union_oracle(ranks, clip: float):
    """``(parameters, initial parameters)`` of SGD over the union of the ranks' batches, each
    example's gradient clipped to ``clip`` by hand, the sum divided by ``world · L``."""
    world = len(ranks)
    model, data = tiny_model(), TokenBlocks()
    start = params_of(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(len(ranks[0]["batches"])):
        total = [torch.zeros_like(p) for p in params]
        for i in sum((r["batches"][step] for r in ranks), []):
            grads = torch.autograd.grad(example_loss(model, i, data), params)
            factor = min(1.0, clip / (float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) + 1e-6))
            total = [t + factor * g for t, g in zip(total, grads)]
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= LR * t / (world * L)
    return params_of(model), start


@pytest.mark.parametrize("mechanism, extra", [("banded", {"bands": 2}), ("blt", {})])
def test_correlated_noise_stops_within_the_budget(tmp_path, mechanism, extra):
    budget = 4.5
    trainer, _ = private_run(tmp_path, PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0, max_epsilon=budget,
                                                        noise_mechanism=mechanism, **extra), max_steps=40)
    assert 0 < trainer.state.global_step < 40
    assert trainer.get_epsilon() <= budget
    history = trainer.privacy_engine.accountant.history
    assert sum(n for _, _, n in history) == trainer.state.global_step


# ---------------------------------------------------------------------------- the example
def test_example_script_runs_offline_and_reports_the_accounted_epsilon(tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_trainer.py")
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = example.main(["--max-examples", "64", "--batch-size", "4", "--accumulation", "2", "--max-steps", "3",
                               "--block-size", "16", "--sigma", "1.5", "--output-dir", str(tmp_path)])
    assert result["steps"] == 3 and math.isfinite(result["eval_loss"])
    replay = create_accountant("prv")
    for _ in range(3):
        replay.step(noise_multiplier=1.5, sample_rate=8 / result["train_examples"])
    assert result["epsilon"] == pytest.approx(replay.get_epsilon(1e-5), rel=1e-9)

"""Checkpoint files: nothing pickled runs on loading, edited histories are refused, signed files
verify, damaged files are named.

Oracle for "nothing ran": a pickled object whose ``__reduce__`` creates a marker directory when
it is unpickled; the test checks the directory does not exist after the (refused) load.
"""

import io
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.checkpoints.file_format import SIGNED_MAGIC, CheckpointIntegrityError

from tests.review.helpers import make_private, tiny_model, train

KEY = b"0123456789abcdef-user-held-key"


class RunsCode:
    """Unpickling this calls ``os.makedirs(marker)``: the side effect a malicious file would have."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


class PlainRecord:
    """A harmless custom class: loadable only with the full unpickler."""

    def __init__(self, value):
        self.value = value


def trained_run(steps=3, **engine_kwargs):
    engine, gsm, optimizer, loader = make_private(tiny_model(), engine_kwargs=engine_kwargs)
    train(gsm, optimizer, loader, steps)
    return engine, gsm, optimizer, loader


def params_of(module):
    return [p.detach().clone() for p in module.parameters()]


def assert_unchanged(module, before):
    for a, b in zip(module.parameters(), before):
        assert torch.equal(a.detach(), b)


# ----------------------------------------------------------------------------- point 1
def test_a_file_holding_a_code_running_object_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"payload": RunsCode(marker)}, path)
    engine, gsm, optimizer, _ = make_private(tiny_model())
    with pytest.raises(pickle.UnpicklingError, match=r"\(os.makedirs\).*safe loader refuses.*weights_only"):
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
    assert not marker.exists()


@pytest.mark.parametrize("secure_mode", [False, True])
def test_a_valid_checkpoint_with_one_extra_malicious_entry_runs_nothing(tmp_path, secure_mode):
    marker = tmp_path / "ran"
    engine, gsm, optimizer, _ = trained_run(secure_mode=secure_mode)
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    state["extra"] = RunsCode(marker)
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5), engine_kwargs=dict(secure_mode=secure_mode))
    before = params_of(gsm2)
    with pytest.raises(pickle.UnpicklingError):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert not marker.exists()
    assert_unchanged(gsm2, before)
    assert len(engine2.accountant) == 0


def test_the_explicit_opt_out_reads_a_trusted_old_file_and_warns(tmp_path):
    engine, gsm, optimizer, _ = trained_run()
    path = tmp_path / "old.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    state["note"] = PlainRecord(7)  # written by hand with torch.save, as older versions allowed
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5))
    with pytest.raises(pickle.UnpicklingError):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    with pytest.warns(UserWarning, match="weights_only=False"):
        rest = engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2,
                                       torch_load_kwargs={"weights_only": False})
    assert rest["note"].value == 7
    assert engine2.accountant.history == engine.accountant.history


@pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")
def test_a_full_checkpoint_round_trips_through_the_safe_loader(tmp_path):
    """Adam, adaptive clipping, a scheduler, the sampler's and the noise generator's states."""
    model = tiny_model()
    engine = PrivacyEngine(accountant="prv")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    from tests.review.helpers import tiny_dataset
    loader = torch.utils.data.DataLoader(tiny_dataset(), batch_size=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
            max_clipbound=10.0, min_clipbound=0.01, unclipped_num_std=2.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    train(gsm, optimizer, loader, 4)
    path = tmp_path / "full.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, checkpoint_dict={"lr": scheduler.state_dict()})
    state = torch.load(path, weights_only=True)  # the safe loader reads every entry
    assert {"optimizer_state_dict", "clipping_state", "noise_generator_state",
            "sampler_generator_state", "privacy_accountant_state_dict"} <= set(state)


def test_saving_an_entry_the_safe_loader_cannot_read_is_refused_before_writing(tmp_path):
    engine, gsm, optimizer, _ = trained_run()
    path = tmp_path / "c.pt"
    with pytest.raises(TypeError, match=r"checkpoint\['best_accuracy'\].*numpy.*float\(x\)"):
        engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer,
                               checkpoint_dict={"best_accuracy": np.float64(0.5)})
    assert not path.exists()
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer,
                           checkpoint_dict={"best_accuracy": 0.5, "nested": {"epochs": [1, 2], "t": torch.ones(2)}})
    assert torch.load(path, weights_only=True)["best_accuracy"] == 0.5


def test_the_examples_resume_refuses_a_malicious_checkpoint(tmp_path, capsys):
    from tests.examples.example_runs import example_module

    example_module("mnist")  # puts examples/ on sys.path
    from common import checkpoints

    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"api": "modern", "x": RunsCode(marker)}, path)
    with pytest.raises(SystemExit, match="safe loader refuses"):
        checkpoints.read(str(path))
    assert not marker.exists()


# ----------------------------------------------------------------------------- point 2
def test_a_shortened_privacy_history_is_refused(tmp_path):
    engine, gsm, optimizer, _ = trained_run(steps=50)
    epsilon = engine.get_epsilon(1e-5)
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    sigma, q, steps = state["privacy_accountant_state_dict"]["history"][0]
    assert steps == 50
    state["privacy_accountant_state_dict"]["history"] = [(sigma, q, 1)]
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5))
    before = params_of(gsm2)
    with pytest.raises(CheckpointIntegrityError, match="records 1 steps.*took 50"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert len(engine2.accountant) == 0 and optimizer2.steps_taken == 0
    assert_unchanged(gsm2, before)
    # the unedited file resumes with the full history and the same ε
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert optimizer2.steps_taken == 50 and engine2.get_epsilon(1e-5) == epsilon


def test_the_step_count_carries_over_resumes(tmp_path):
    engine, gsm, optimizer, loader = trained_run(steps=4)
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    engine2, gsm2, optimizer2, loader2 = make_private(tiny_model(seed=5))
    engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    train(gsm2, optimizer2, loader2, 3)
    engine2.save_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert torch.load(path, weights_only=True)["dp_optimizer_steps"] == 7 == sum(h[2] for h in engine2.accountant.history)
    engine3, gsm3, optimizer3, _ = make_private(tiny_model(seed=6))
    engine3.load_checkpoint(path=path, module=gsm3, optimizer=optimizer3)
    assert optimizer3.steps_taken == 7


def _signed_run(tmp_path, steps=5):
    engine, gsm, optimizer, _ = trained_run(steps=steps)
    path = tmp_path / "signed.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=KEY)
    return engine, path


def test_a_signed_checkpoint_verifies_and_never_contains_the_key(tmp_path):
    engine, path = _signed_run(tmp_path)
    assert KEY not in path.read_bytes()
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5))
    engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2, signing_key=KEY)
    assert engine2.accountant.history == engine.accountant.history


def _tampered_payload(path, edit):
    """Edit the payload of a signed file (``MAGIC ‖ 32-byte MAC ‖ payload``), keeping its MAC."""
    raw = path.read_bytes()
    head = len(SIGNED_MAGIC) + 32
    state = torch.load(io.BytesIO(raw[head:]), weights_only=True)
    edit(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(raw[:head] + buffer.getvalue())


def test_an_edited_signed_checkpoint_is_refused(tmp_path):
    engine, path = _signed_run(tmp_path)

    def shorten(state):  # consistent with every counter: only the signature can tell
        sigma, q, _ = state["privacy_accountant_state_dict"]["history"][0]
        state["privacy_accountant_state_dict"]["history"] = [(sigma, q, 1)]
        state["dp_optimizer_steps"] = 1

    _tampered_payload(path, shorten)
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5))
    before = params_of(gsm2)
    with pytest.raises(CheckpointIntegrityError, match="signature does not verify"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2, signing_key=KEY)
    assert len(engine2.accountant) == 0
    assert_unchanged(gsm2, before)


def test_wrong_key_unsigned_file_and_missing_key(tmp_path):
    engine, path = _signed_run(tmp_path)
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5))
    with pytest.raises(CheckpointIntegrityError, match="does not verify"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2, signing_key=b"another-key-of-16+bytes")
    with pytest.warns(UserWarning, match="integrity was NOT checked"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert path.read_bytes().startswith(SIGNED_MAGIC)
    unsigned = tmp_path / "plain.pt"
    engine.save_checkpoint(path=unsigned, module=gsm2, optimizer=optimizer2)
    with pytest.raises(CheckpointIntegrityError, match="not signed"):
        engine2.load_checkpoint(path=unsigned, module=gsm2, optimizer=optimizer2, signing_key=KEY)
    with pytest.raises(ValueError, match="at least 16"):
        engine.save_checkpoint(path=unsigned, module=gsm2, optimizer=optimizer2, signing_key="short")


# ----------------------------------------------------------------------------- point 7
@pytest.mark.parametrize("keep", [0.5, 0.05, 0.0])
def test_a_truncated_checkpoint_is_named_as_such(tmp_path, keep):
    engine, gsm, optimizer, _ = trained_run()
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    engine2, gsm2, optimizer2, _ = make_private(tiny_model(seed=5))
    before = params_of(gsm2)
    with pytest.raises(ValueError, match=f"checkpoint {path} is corrupt or truncated"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert_unchanged(gsm2, before)


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_bytes(b"not a checkpoint " * 20)
    engine, gsm, optimizer, _ = make_private(tiny_model())
    with pytest.raises(ValueError, match="corrupt or truncated"):
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
    torch.save(nn.Linear(2, 2).state_dict()["weight"], path)
    with pytest.raises(ValueError, match="holds a Tensor, not the dict"):
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)

"""Single-file checkpoints under misuse: the signature is checked on the raw bytes before anything
is unpickled, every integrity field is typed and ranged, a load inside a logical batch is
refused, and a history of another accountant type is converted with a warning.

Oracles: a pickled object whose ``__reduce__`` creates a marker directory ("nothing ran" = the
directory does not exist); a second, untouched engine for "nothing changed"; accountants given
the same (σ, q, steps) history directly for ε; a twin run without the refused load for the step.
"""

import copy
import io
import math
import os
import warnings

import pytest
import torch

from opacus_dp.accountants import create_accountant
from opacus_dp.checkpoints.consistency import LoadInsideLogicalBatchError
from opacus_dp.checkpoints.file_format import SIGNED_FORMAT, SIGNED_MAGIC, CheckpointIntegrityError
from opacus_dp.data.batch_memory_manager import BatchMemoryManager

from tests.review.helpers import loss_of, make_private, tiny_model, train

KEY = b"0123456789abcdef-user-held-key"
UNSAFE = {"weights_only": False}


class RunsCode:
    """Unpickling this calls ``os.makedirs(marker)``: what a malicious file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def trained(steps=5, seed=0, **engine_kwargs):
    engine, gsm, optimizer, loader = make_private(tiny_model(seed), engine_kwargs=engine_kwargs)
    train(gsm, optimizer, loader, steps)
    return engine, gsm, optimizer, loader


def fresh(seed=5, **engine_kwargs):
    return make_private(tiny_model(seed), engine_kwargs=engine_kwargs)


class Unchanged:
    """Model, optimizer, accountant of a run, captured to check that a refused load changed nothing."""

    def __init__(self, engine, gsm, optimizer):
        self.run = (engine, gsm, optimizer)
        self.params = [p.detach().clone() for p in gsm.parameters()]
        self.history = list(engine.accountant.history)
        self.steps = optimizer.steps_taken
        self.opt_state = copy.deepcopy(optimizer.state_dict())

    def check(self):
        engine, gsm, optimizer = self.run
        assert all(torch.equal(a.detach(), b) for a, b in zip(gsm.parameters(), self.params))
        assert engine.accountant.history == self.history
        assert optimizer.steps_taken == self.steps
        assert str(optimizer.state_dict()) == str(self.opt_state)


# ----------------------------------------------------------------------------- the signature first
def _signed_file(tmp_path):
    engine, gsm, optimizer, _ = trained()
    path = tmp_path / "signed.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=KEY)
    return engine, path


def _malicious_pickle(marker) -> bytes:
    buffer = io.BytesIO()
    torch.save({"module_state_dict": RunsCode(marker)}, buffer)
    return buffer.getvalue()


def _unsigned(tmp_path, marker):
    path = tmp_path / "unsigned.pt"
    path.write_bytes(_malicious_pickle(marker))
    return path


def _forged_old_envelope(tmp_path, marker):
    """The earlier envelope layout (a torch.save'd dict), with the payload next to it."""
    path = tmp_path / "forged_v1.pt"
    payload = _malicious_pickle(marker)
    torch.save({SIGNED_FORMAT: 1, "mac": "0" * 64, "extra": RunsCode(marker),
                "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, path)
    return path


def _forged_header(tmp_path, marker):
    """A valid signed file's header and MAC (``MAGIC ‖ 32 bytes``), then a malicious payload."""
    _, signed = _signed_file(tmp_path)
    raw = signed.read_bytes()
    assert raw.startswith(SIGNED_MAGIC)
    path = tmp_path / "forged_v2.pt"
    path.write_bytes(raw[:len(SIGNED_MAGIC) + 32] + _malicious_pickle(marker))
    return path


def _altered(tmp_path, marker):
    """A valid signed file with one payload byte flipped."""
    _, signed = _signed_file(tmp_path)
    raw = bytearray(signed.read_bytes())
    raw[-200] ^= 0x01
    path = tmp_path / "altered.pt"
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("make_file", [_unsigned, _forged_old_envelope, _forged_header, _altered])
@pytest.mark.parametrize("load_kwargs", [UNSAFE, None])
def test_with_a_key_nothing_is_unpickled_before_the_signature_verifies(tmp_path, make_file, load_kwargs):
    marker = tmp_path / "ran"
    path = make_file(tmp_path, marker)
    engine, gsm, optimizer, _ = fresh()
    before = Unchanged(engine, gsm, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointIntegrityError, match=str(path)):
            engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=KEY,
                                   torch_load_kwargs=load_kwargs)
    assert not marker.exists()
    before.check()


def test_a_signed_file_is_header_mac_payload_and_round_trips(tmp_path):
    engine, path = _signed_file(tmp_path)
    raw = path.read_bytes()
    assert not raw.startswith(b"PK") and KEY not in raw  # not a torch archive: MAC checkable on raw bytes
    engine2, gsm2, optimizer2, _ = fresh()
    with pytest.warns(UserWarning, match="weights_only=False"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2, signing_key=KEY,
                                torch_load_kwargs=UNSAFE)
    assert engine2.accountant.history == engine.accountant.history
    engine3, gsm3, optimizer3, _ = fresh()
    with pytest.warns(UserWarning, match="integrity was NOT checked"):
        engine3.load_checkpoint(path=path, module=gsm3, optimizer=optimizer3)
    assert engine3.accountant.history == engine.accountant.history


def test_an_old_signed_file_is_refused_with_a_key_and_read_without_one(tmp_path):
    """The earlier layout (a torch archive holding payload and MAC) cannot be verified without
    unpickling its envelope: with a key it is refused, naming the way out."""
    import hashlib
    import hmac

    engine, gsm, optimizer, _ = trained()
    engine.save_checkpoint(path=tmp_path / "plain.pt", module=gsm, optimizer=optimizer)
    payload = (tmp_path / "plain.pt").read_bytes()
    mac = hmac.new(KEY, b"opacus_dp checkpoint v1\x00" + payload, hashlib.sha256).hexdigest()
    path = tmp_path / "v1.pt"
    torch.save({SIGNED_FORMAT: 1, "mac": mac, "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)},
               path)
    engine2, gsm2, optimizer2, _ = fresh()
    with pytest.raises(CheckpointIntegrityError, match="earlier signed format.*save_checkpoint"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2, signing_key=KEY)
    with pytest.warns(UserWarning, match="integrity was NOT checked"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert engine2.accountant.history == engine.accountant.history


# ----------------------------------------------------------------------------- typed integrity fields
NAN = float("nan")


def _set_steps(value):
    def edit(state):
        if value is _MISSING:
            del state["dp_optimizer_steps"]
        else:
            state["dp_optimizer_steps"] = value
    return edit


def _set_entry(position, value):
    def edit(state):
        entry = list(state["privacy_accountant_state_dict"]["history"][0])
        if value is _MISSING:
            del entry[position]
        else:
            entry[position] = value
        state["privacy_accountant_state_dict"]["history"][0] = tuple(entry)
    return edit


def _set_accountant_key(key, value):
    def edit(state):
        if value is _MISSING:
            del state["privacy_accountant_state_dict"][key]
        else:
            state["privacy_accountant_state_dict"][key] = value
    return edit


_MISSING = object()
MALFORMED = (
    [("dp_optimizer_steps", _set_steps(v)) for v in (5.0, True, -1, NAN, "5")]
    + [("num_steps", _set_entry(2, v)) for v in (5.0, True, -1, NAN, "5")]
    + [("noise_multiplier", _set_entry(0, v)) for v in (True, -1.0, NAN, math.inf, "1.0")]
    + [("sample_rate", _set_entry(1, v)) for v in (True, -0.25, 1.5, NAN, "0.25")]
    + [(r"\['history'\]\[0\] is", _set_entry(2, _MISSING))]
    + [("history", _set_accountant_key("history", v)) for v in ("5", None, _MISSING)]
    + [("mechanism", _set_accountant_key("mechanism", v)) for v in (5, "moments", _MISSING)]
)


@pytest.mark.parametrize("field,edit", MALFORMED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MALFORMED)])
def test_a_malformed_integrity_field_is_refused_naming_it(tmp_path, field, edit):
    engine, gsm, optimizer, _ = trained()
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = trained(steps=2, seed=3)
    before = Unchanged(engine2, gsm2, optimizer2)
    with pytest.raises(CheckpointIntegrityError, match=field):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    before.check()


def test_a_checkpoint_without_step_counter_loads_with_a_warning(tmp_path):
    """Opacus writes no step counter: such a file resumes (history as saved), with a warning that
    it cannot be cross-checked."""
    engine, gsm, optimizer, _ = trained(steps=3)
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    del state["dp_optimizer_steps"]
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = trained(steps=2, seed=3)
    with pytest.warns(UserWarning, match="no dp_optimizer_steps"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert engine2.accountant.history == engine.accountant.history


def test_a_float_step_counter_cannot_hide_a_shortened_history(tmp_path):
    """The edit of the report: history shortened to one step, counter written as a float."""
    engine, gsm, optimizer, _ = trained(steps=5)
    epsilon = engine.get_epsilon(1e-5)
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    sigma, q, steps = state["privacy_accountant_state_dict"]["history"][0]
    state["privacy_accountant_state_dict"]["history"] = [(sigma, q, 2)]
    state["dp_optimizer_steps"] = 5.0
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = fresh()
    with pytest.raises(CheckpointIntegrityError, match="dp_optimizer_steps"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert len(engine2.accountant) == 0
    oracle = create_accountant(engine.accountant.mechanism())
    oracle.history = [(sigma, q, 5)]  # the five steps taken, the ε the edit tried to lower
    assert epsilon == oracle.get_epsilon(1e-5)
    oracle.history = [(sigma, q, 2)]
    assert oracle.get_epsilon(1e-5) < epsilon


# ----------------------------------------------------------------------------- inside a logical batch
def _bmm_run(seed=0):
    torch.manual_seed(seed)
    engine, gsm, optimizer, loader = make_private(tiny_model(seed), n=40, batch_size=12, poisson_sampling=True)
    return engine, gsm, optimizer, loader


def _bmm_steps(gsm, optimizer, loader, *, logical_steps, on_first_piece=None):
    taken = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical:
        for x, y in physical:
            loss_of(gsm, x, y).backward()
            before = optimizer.steps_taken
            optimizer.step()
            optimizer.zero_grad()
            if optimizer.steps_taken == before and on_first_piece is not None:
                on_first_piece()
                on_first_piece = None
            taken += optimizer.steps_taken - before
            if taken == logical_steps:
                return


def test_a_load_inside_a_logical_batch_is_refused_and_changes_nothing(tmp_path):
    saved_engine, saved_gsm, saved_optimizer, _ = trained(steps=3, seed=7)
    path = tmp_path / "c.pt"
    saved_engine.save_checkpoint(path=path, module=saved_gsm, optimizer=saved_optimizer)

    engine, gsm, optimizer, loader = _bmm_run()
    refused = []

    def load_mid_batch():
        before = Unchanged(engine, gsm, optimizer)
        with pytest.raises(LoadInsideLogicalBatchError, match="between steps"):
            engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
        before.check()
        refused.append(True)

    _bmm_steps(gsm, optimizer, loader, logical_steps=2, on_first_piece=load_mid_batch)
    assert refused == [True]
    # the interrupted loop goes on exactly as a run that never tried to load
    engine_b, gsm_b, optimizer_b, loader_b = _bmm_run()
    _bmm_steps(gsm_b, optimizer_b, loader_b, logical_steps=2)
    for a, b in zip(gsm.parameters(), gsm_b.parameters()):
        assert torch.equal(a, b)
    assert engine.accountant.history == engine_b.accountant.history
    # between two steps the same load is accepted
    engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
    assert engine.accountant.history == saved_engine.accountant.history


# ----------------------------------------------------------------------------- another accountant's history
@pytest.mark.parametrize("saved,target", [("rdp", "prv"), ("prv", "rdp"), ("rdp", "gdp")])
def test_a_history_of_another_accountant_type_is_converted_with_a_warning(tmp_path, saved, target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, gsm, optimizer, _ = trained(steps=4, accountant=saved)
        path = tmp_path / "c.pt"
        engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
        engine2, gsm2, optimizer2, _ = fresh(accountant=target)
    with pytest.warns(UserWarning, match=f"{saved!r} accountant.*{target!r}"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert engine2.accountant.mechanism() == target
    assert engine2.accountant.history == engine.accountant.history
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = create_accountant(target)
    oracle.history = list(engine.accountant.history)
    assert engine2.get_epsilon(1e-5) == oracle.get_epsilon(1e-5)
    assert isinstance(engine2.accountant.history[0][2], int)


def test_a_history_of_an_unknown_accountant_type_is_refused(tmp_path):
    engine, gsm, optimizer, _ = trained()
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    state["privacy_accountant_state_dict"]["mechanism"] = "my_custom"
    torch.save(state, path)
    engine2, gsm2, optimizer2, _ = fresh()
    before = Unchanged(engine2, gsm2, optimizer2)
    with pytest.raises(CheckpointIntegrityError, match="mechanism.*my_custom"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    before.check()


def test_loading_an_older_checkpoint_into_a_run_that_went_further_warns(tmp_path):
    """The history goes back with the model: the later steps stop counting, which is right only if
    nothing they trained was published, so the user is told how many steps are dropped."""
    engine, gsm, optimizer, loader = trained(steps=3)
    engine.save_checkpoint(path=tmp_path / "three.pt", module=gsm, optimizer=optimizer)
    train(gsm, optimizer, loader, 2)
    assert len(engine.accountant) == 5
    with pytest.warns(UserWarning, match="from 5 released private steps to 3.*2 later steps"):
        engine.load_checkpoint(path=tmp_path / "three.pt", module=gsm, optimizer=optimizer)
    assert len(engine.accountant) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same checkpoint into a fresh run: nothing goes back
        fresh_engine, fresh_gsm, fresh_optimizer, _ = fresh()
        fresh_engine.load_checkpoint(path=tmp_path / "three.pt", module=fresh_gsm, optimizer=fresh_optimizer)

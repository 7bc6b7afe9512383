"""The pinning harness itself: a rerun is bitwise, a one-ulp change of the learning rate is seen
(exactly) and tolerated (across machines), a larger change is not, a failing case is an error
entry rather than a crash, and a missing pin names the command that writes it."""

import hashlib

import pytest
import torch

from tests.pinning import cases
from tests.pinning.compare import compare_case, decode_tensor
from tests.pinning.pin import encode_case, encode_tensor, load_pin

CASE = cases.Case()  # local MLP, hooks, flat clipping, independent noise, make_private


def _entry(case=CASE):
    return encode_case([cases.run_case(case)])


def test_a_tensor_is_pinned_by_the_hash_of_its_bytes_and_restored_bitwise():
    for t in (torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.tensor([-0.0, float("nan")])):
        entry = encode_tensor(t)
        assert entry["sha256"] == hashlib.sha256(t.numpy().tobytes()).hexdigest()
        back = decode_tensor(entry)
        assert back.dtype == t.dtype and back.numpy().tobytes() == t.numpy().tobytes()


def test_a_rerun_is_bitwise_and_a_one_ulp_learning_rate_is_seen(monkeypatch):
    pinned = _entry()
    assert compare_case("c", pinned, _entry(), exact=True).status == "bitwise"
    plain = cases.run_case(CASE)
    monkeypatch.setenv(cases.PERTURB_ENV, "1")
    moved = cases.run_case(CASE)
    verdict = compare_case("c", pinned, encode_case([moved]), exact=True)
    assert verdict.status == "differs"
    largest = max(float((b.double() - a.double()).abs().max()) for a, b in zip(plain["params"], moved["params"]))
    assert 0 < largest and f"max |Δ| = {largest:.3e}" in verdict.detail
    assert compare_case("c", pinned, encode_case([moved]), exact=False).status == "within tolerance"


def test_a_change_beyond_tolerance_differs_on_another_machine_too():
    pinned, report = _entry(), cases.run_case(CASE)
    report["params"][0] = report["params"][0] * (1 + 1e-3)
    assert compare_case("c", pinned, encode_case([report]), exact=False).status == "differs"
    report = cases.run_case(CASE)
    report["epsilon"] *= 1 + 1e-8  # ε may drift only by 1e-9 relative
    verdict = compare_case("c", pinned, encode_case([report]), exact=False)
    assert verdict.status == "differs" and "epsilon" in verdict.detail


def test_a_calibrated_sigma_may_move_within_the_calibration_window_on_another_machine():
    """``make_private_with_epsilon`` stops anywhere in its ε window; the noise moves with σ."""
    case = cases.Case(api="with_epsilon")
    pinned, report = _entry(case), cases.run_case(case)
    change = 2e-4  # as seen between two x86 machines (PRV)
    report["noise_multiplier"] *= 1 + change
    report["epsilon"] *= 1 + change
    report["history"] = [[s * (1 + change), q, n] for s, q, n in report["history"]]
    report["grads"] = [g * (1 + change / 2) if g is not None else None for g in report["grads"]]
    moved = encode_case([report])
    assert compare_case(case.name, pinned, moved, exact=False).status == "within tolerance"
    assert compare_case(case.name, pinned, moved, exact=True).status == "differs"
    assert compare_case(CASE.name, pinned, moved, exact=False).status == "differs"  # not calibrated
    report["noise_multiplier"] *= 1.01  # beyond the window
    assert compare_case(case.name, pinned, encode_case([report]), exact=False).status == "differs"


def test_a_case_that_raises_is_an_error_entry_and_the_next_case_still_runs(monkeypatch):
    second, real, calls = cases.Case(mode="bk"), cases.make_model, []

    def broken_once(family):
        calls.append(family)
        if len(calls) == 1:
            raise RuntimeError("broken model")
        return real(family)

    monkeypatch.setattr(cases, "CASES", {"local": [CASE, second]})
    monkeypatch.setattr(cases, "make_model", broken_once)
    results = cases.run_cases(0, 1, "local")
    assert "RuntimeError: broken model" in results[CASE.name]["error"]
    entry = encode_case([results[CASE.name]])
    assert set(entry) == {"error"}
    assert "error" not in results[second.name] and len(results[second.name]["params"]) == 4
    assert compare_case(CASE.name, _entry(), entry, exact=True).status == "error"


def test_a_case_missing_on_either_side_differs():
    pinned = _entry()
    assert compare_case("c", None, pinned, exact=True).status == "differs"
    assert compare_case("c", pinned, None, exact=False).status == "differs"


def test_a_missing_pin_file_names_the_command_that_records_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/pin_behaviour.py record"):
        load_pin(tmp_path / "behaviour_pin.json")


def test_the_cases_run_with_torchs_products_whatever_the_user_set(monkeypatch):
    from opacus_dp.maths import cpu_products

    if not cpu_products.onednn_available():
        pytest.skip("torch built without oneDNN")
    seen = []
    monkeypatch.setattr(cases, "CASES", {"local": [CASE]})
    monkeypatch.setattr(cases, "run_case", lambda case, rank, world: seen.append(cpu_products.cpu_products()) or {})
    with cpu_products.cpu_products_set_to("onednn"):
        cases.run_cases(0, 1, "local")
        assert cpu_products.cpu_products() == "onednn"
    assert seen == ["torch"]

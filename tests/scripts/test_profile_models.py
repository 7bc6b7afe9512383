"""scripts/profile_models.py: each single-device model's private step timed phase by phase beside the
non-private step; the phases add up to the step and the ratio is the steps' quotient."""

import pytest

from tests.script_loading import load_script


def load():
    return load_script("profile_models.py", "profile_models")


@pytest.mark.parametrize("fast_noise", ["off", "philox"])
def test_phases_add_up_and_only_the_private_step_clips(capsys, fast_noise):
    results = load().main(["--models", "lstm", "--steps", "1", "--warmup", "0", "--fast-noise", fast_noise])
    rows = results["lstm"]
    assert set(rows) == {"non-private", "bk"}
    phases = ("forward", "backward", "clip", "reduce", "noise", "scale", "inner", "other")
    for row in rows.values():
        assert sum(row[k] for k in phases) == pytest.approx(row["total"])
    assert rows["bk"]["clip"] > 0 and rows["bk"]["noise"] > 0
    assert all(rows["non-private"][k] == 0 for k in ("clip", "noise", "scale"))
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| bk |"))
    assert printed.split("|")[-2].strip() == f"{rows['bk']['total'] / rows['non-private']['total']:.2f}"


def test_batch_size_keeps_the_first_samples(capsys, monkeypatch):
    """``--batch-size 2``: every setting steps on the first two samples of the model's batch."""
    module = load()
    seen = []
    step_phases = module.step_phases

    def recording(model, optimizer, criterion, x, y, *args, **kwargs):
        seen.append((x.shape[0], y.shape[0]))
        return step_phases(model, optimizer, criterion, x, y, *args, **kwargs)

    monkeypatch.setattr(module, "step_phases", recording)
    rows = module.main(["--models", "lstm", "--steps", "1", "--warmup", "0", "--batch-size", "2"])["lstm"]
    assert seen == [(2, 2), (2, 2)] and set(rows) == {"non-private", "bk"}
    assert "(its first 2 samples)" in capsys.readouterr().out


@pytest.mark.parametrize("timer, clock", [("cpu", "process_time"), ("wall", "perf_counter")])
def test_timer_chooses_the_clock_of_every_phase(capsys, monkeypatch, timer, clock):
    """``--timer wall`` times the phases by the wall clock (several threads), ``cpu`` (default) by
    the process's CPU time; the header names the clock."""
    module = load()
    clocks = []
    step_phases = module.step_phases

    def recording(*args, clock, **kwargs):
        clocks.append(clock)
        return step_phases(*args, clock=clock, **kwargs)

    monkeypatch.setattr(module, "step_phases", recording)
    module.main(["--models", "lstm", "--steps", "1", "--warmup", "0", "--batch-size", "2", "--timer", timer])
    assert [c.__name__ for c in clocks] == [clock, clock]
    assert f"median {'wall-clock' if timer == 'wall' else 'process CPU'} ms" in capsys.readouterr().out


def test_compile_compiles_every_setting_in_place(capsys, monkeypatch):
    """``--compile BACKEND``: the non-private and the private model are compiled in place with it
    (the private one after make_private), and the header says so."""
    module = load()
    backends = []
    build = module.build

    def recording(workload, mode, x, y, fast_noise, backend=None):
        model, *rest = build(workload, mode, x, y, fast_noise, backend)
        compiled = getattr(model, "_compiled_model_call", None) or model._compiled_call_impl  # private: the wrapped call
        backends.append((mode, backend, compiled is not None))
        return (model, *rest)

    monkeypatch.setattr(module, "build", recording)
    rows = module.main(["--models", "lstm", "--steps", "1", "--warmup", "1", "--batch-size", "2",
                        "--compile", "eager"])["lstm"]
    assert backends == [(None, "eager", True), ("bk", "eager", True)]
    assert rows["bk"]["clip"] > 0 and rows["non-private"]["clip"] == 0
    assert "compiled by eager" in capsys.readouterr().out

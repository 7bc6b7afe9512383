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

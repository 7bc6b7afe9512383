"""``scripts/opacus_examples.py``: Opacus 1.6.0's own example scripts run unchanged through
``python -m opacus_dp.as_opacus`` on synthetic data, each exiting 0 with a finite ε, except the
runs that docs/compatibility.md lists with a reason.

The end-to-end test downloads the Opacus sdist once (pip, into ``.cache/opacus_examples``) and is
skipped with the script's reason where it cannot (exit status 3). Its nine runs take about a
minute with two at a time on two cores.
"""

import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loading import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "opacus_examples.py"


def _load_script():
    return load_script("opacus_examples.py", "opacus_examples_script")


examples = _load_script()


def _outcome(name, returncode, epsilon):
    return examples.Outcome(name, "opacus_dp", returncode, epsilon, "", "tail", 1.0)


def test_the_known_failures_are_listed_runs_with_a_reason():
    known = examples.read_known_failures()
    assert set(known) <= {e.name for e in examples.EXAMPLES}
    assert all(category in examples.CATEGORIES and reason for category, reason in known.values())


def test_a_row_naming_no_run_is_refused(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"{examples.DOC_SECTION}\n\n| Run | Category | Reason |\n|---|---|---|\n"
                   "| `mnist-typo` | deliberate-difference | r |\n", encoding="utf-8")
    with pytest.raises(ValueError, match="mnist-typo"):
        examples.read_known_failures(doc)


def test_the_last_epsilon_printed_is_read_from_lines_and_progress_bars():
    output = ("Train Epoch: 1 (ε = 4.21, δ = 1e-05)\n"
              "epoch: 0 (ε = 3.53, δ = 0.00):  50%|\repoch: 0 (ε = 4.85, δ = 0.00): 100%|\nTest set\n")
    assert examples.last_epsilon(output) == (4.85, "epoch: 0 (ε = 4.85, δ = 0.00): 100%|")
    assert examples.last_epsilon("Loss: 2.3\n") == (None, "")
    assert math.isnan(examples.last_epsilon("(ε = nan, δ = 1e-05)")[0])


def test_a_run_passes_only_with_exit_status_0_and_a_finite_epsilon():
    assert _outcome("mnist", 0, 4.2).passed
    assert not _outcome("mnist", 1, 4.2).passed
    assert not _outcome("mnist", 0, None).passed
    assert not _outcome("mnist", 0, float("inf")).passed
    assert not _outcome("mnist", None, 4.2).passed  # timed out


def test_an_unlisted_failure_is_unexpected_and_a_listed_one_is_not():
    known = {"cifar10-no_op": ("deliberate-difference", "r")}
    outcomes = [_outcome("mnist", 1, None), _outcome("cifar10-no_op", 1, None), _outcome("dcgan", 0, 1.0)]
    _, unexpected = examples.report(outcomes, known)
    assert unexpected == ["mnist"]
    lines, unexpected = examples.report([_outcome("cifar10-no_op", 0, 1.0)], known)
    assert unexpected == [] and any("listed failure passes now: cifar10-no_op" in line for line in lines)


def test_the_synthetic_data_has_the_real_formats(tmp_path):
    values = examples.write_data(tmp_path, "cpu")
    data = Path(values["data"])
    labels = (data / "MNIST" / "raw" / "train-labels-idx1-ubyte").read_bytes()
    assert labels[:8] == (2049).to_bytes(4, "big") + (64).to_bytes(4, "big")
    assert int(values["digit"]) in labels[8:]
    with open(data / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        batch = pickle.load(f)
    assert batch["data"].shape == (8, 3072) and len(batch["labels"]) == 8
    assert (data / "cifar-10-batches-py" / "SYNTHETIC").is_file()
    assert sorted(p.suffix for p in Path(values["names"]).iterdir()) == [".txt"] * 3


def test_a_cached_sdist_of_other_content_is_refused(tmp_path):
    (tmp_path / examples.SDIST).write_bytes(b"not the Opacus sdist")
    with pytest.raises(examples.Unavailable, match="SHA-256"):
        examples.fetch_sdist(tmp_path)


@pytest.mark.slow
def test_opacus_examples_run_unchanged_through_the_alias(tmp_path):
    record_path = tmp_path / "outcomes.json"
    command = [sys.executable, str(SCRIPT), "--jobs", "2", "--json", str(record_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode == examples.EXIT_UNAVAILABLE:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode in (0, examples.EXIT_UNEXPECTED), done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(record_path.read_text(encoding="utf-8"))
    known = examples.read_known_failures()
    outcomes = {o["name"]: o for o in record["outcomes"]}
    assert set(outcomes) == {e.name for e in examples.EXAMPLES}
    failed = {name: o["tail"] for name, o in outcomes.items() if name not in known and not (
        o["returncode"] == 0 and o["epsilon"] is not None and math.isfinite(o["epsilon"]))}
    assert not failed, "Opacus examples failing through the alias:\n" + "\n".join(
        f"{name}:\n{tail}" for name, tail in failed.items())
    assert record["unexpected"] == [] and done.returncode == 0

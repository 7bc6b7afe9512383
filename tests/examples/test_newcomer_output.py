"""What a first run of an example prints and leaves behind: the ``privacy:`` settings line, the
ε of the progress bar, notes on degenerate sampling, resume messages, output locations,
``--help`` and the secure-mode notice.

Oracles: the settings line is compared with q = B·R/N and ⌈1/q⌉ computed here; the progress
bar's last ε with the final printed ε (same rounding); file locations with ``git status`` of a
fresh repository used as working directory.
"""

import argparse
import math
import os
import re
import subprocess

import pytest
import torch

from tests.examples.example_runs import (
    EXAMPLES,
    example_module,
    printed_epsilon,
    read_json,
    recomputed_epsilon,
    run_example,
)

pytestmark = pytest.mark.slow

SIGMA = 1.5
PRIVACY_LINE = re.compile(r"privacy: sigma=(\S+) q=(\S+) steps_per_epoch=(\d+) delta=(\S+) "
                          r"accountant=(\w+) planned_steps=(\d+)")
TINY_CIFAR = ["--synthetic", "--synthetic-size", 40, "--width", 4, "--sigma", SIGMA, "--batch-size", 8]


def _privacy(output: str) -> dict:
    found = PRIVACY_LINE.findall(output)
    assert len(found) == 1, output
    sigma, q, per_epoch, delta, accountant, planned = found[0]
    return {"sigma": float(sigma), "q": float(q), "steps_per_epoch": int(per_epoch),
            "delta": float(delta), "accountant": accountant, "planned_steps": int(planned)}


def _run_with_stderr(name, argv, capsys):
    """``(stdout, stderr)`` of ``examples/<name>.py argv`` run in this process."""
    module = example_module(name)
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only contend on a shared machine
    try:
        assert module.main([str(a) for a in argv]) in (0, None)
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return captured.out, captured.err


# ------------------------------------------------------------------------ privacy line, ε
@pytest.mark.parametrize("name, argv, n, batch", [
    ("cifar10", TINY_CIFAR, 40, 8),
    ("mnist", ["--synthetic", "--synthetic-size", 48, "--width", 4, "--sigma", SIGMA, "--batch-size", 12], 48, 12),
    ("char_lstm", ["--synthetic", "--synthetic-size", 40, "--embedding-size", 4, "--hidden-size", 4,
                   "--sigma", SIGMA, "--batch-size", 10], 40, 10),
    ("dcgan", ["--synthetic", "--synthetic-size", 30, "--image-size", 8, "--ngf", 4, "--ndf", 4, "--nz", 8,
               "--sigma", SIGMA, "--batch-size", 10], 30, 10),
])
def test_every_example_prints_its_privacy_settings_first(name, argv, n, batch, tmp_path, capsys):
    outputs = ["--metrics-file", tmp_path / "m.json", "--no-progress"]
    outputs += ["--outf", tmp_path] if name == "dcgan" else ["--checkpoint-file", tmp_path / "c.pt"]
    out, _ = _run_with_stderr(name, [*argv, "--epochs", 2, *outputs], capsys)
    privacy = _privacy(out)
    q = batch / n
    assert privacy["sigma"] == SIGMA and privacy["delta"] == 1e-5 and privacy["accountant"] == "prv"
    assert math.isclose(privacy["q"], q, rel_tol=1e-12)
    assert privacy["steps_per_epoch"] == round(1 / q)  # 1/q is a whole number in every case here
    assert privacy["planned_steps"] == 2 * privacy["steps_per_epoch"]
    assert out.index("privacy: ") < out.index("epoch 1:")  # before training starts
    metrics = read_json(tmp_path / "m.json")
    assert sum(int(r[2]) for r in metrics["privacy"]["history"]) == privacy["planned_steps"]
    assert printed_epsilon(out) == pytest.approx(recomputed_epsilon(metrics["privacy"]), abs=5e-6)


@pytest.mark.parametrize("name, argv", [
    ("cifar10", [*TINY_CIFAR, "--checkpoint-file", "{tmp}/c.pt"]),
    ("dcgan", ["--synthetic", "--synthetic-size", 30, "--image-size", 8, "--ngf", 4, "--ndf", 4, "--nz", 8,
               "--sigma", SIGMA, "--batch-size", 10, "--outf", "{tmp}"]),
])
def test_progress_bar_ends_at_the_final_epsilon(name, argv, tmp_path, capsys):
    # -p 1000: without a refresh after the last step the bar would still show the first step's ε.
    argv = [str(a).format(tmp=tmp_path) for a in argv] + ["--epochs", 1, "-p", 1000]
    out, err = _run_with_stderr(name, argv, capsys)
    shown = re.findall(r"eps=([0-9.]+)", err)
    final = printed_epsilon(out)
    assert shown, err
    assert float(shown[-1]) == pytest.approx(round(final, 3), abs=5e-4), (shown, final)
    assert float(shown[0]) < final  # the first step's ε was shown too, then replaced


# ------------------------------------------------------------------------ sampling notes
def test_batch_as_large_as_the_data_is_said_once(tmp_path, capsys):
    argv = ["--synthetic", "--synthetic-size", 16, "--width", 4, "--batch-size", 32, "--epochs", 1,
            "--checkpoint-file", tmp_path / "c.pt", "--no-progress"]
    out, err = _run_with_stderr("cifar10", argv, capsys)
    notes = [line for line in err.splitlines() if "sample rate q = 1" in line]
    assert len(notes) == 1, err
    assert "--batch-size 32 is larger than the training set of 16 examples" in notes[0]
    assert _privacy(out)["q"] == 1.0


def test_world_split_to_sample_rate_one_is_named():
    from common.cli import sampling_notes

    args = argparse.Namespace(batch_size=8, n_accumulation_steps=1, sample_rate=None)
    # 8 per process × 2 processes = the 16 examples: q = 1 although one process's batch fits.
    (note,) = sampling_notes(args, num_samples=16, world_size=2)
    assert "sample rate q = 1" in note and "2 processes" in note
    assert "larger than the training set" not in note
    assert sampling_notes(args, num_samples=17, world_size=2) == []
    explicit = argparse.Namespace(batch_size=1, n_accumulation_steps=1, sample_rate=1.0)
    assert "--sample-rate 1" in sampling_notes(explicit, num_samples=100, world_size=1)[0]


# ------------------------------------------------------------------------ resume
def test_resume_says_where_it_continues_and_when_nothing_is_left(tmp_path, capsys):
    path = tmp_path / "c.pt"
    argv = [*TINY_CIFAR, "--checkpoint-file", path, "--metrics-file", tmp_path / "m.json", "--no-progress"]
    run_example("cifar10", [*argv, "--epochs", 1], capsys)
    first = read_json(tmp_path / "m.json")
    out = run_example("cifar10", [*argv, "--epochs", 2, "--resume", path], capsys)
    epsilon = recomputed_epsilon(first["privacy"])
    assert f"resumed from {path} at step 5 (ε = {epsilon:.3f})" in out, out
    again = run_example("cifar10", [*argv, "--epochs", 2, "--resume", path], capsys)
    assert f"checkpoint {path} already covers the planned 10 steps: nothing to do" in again, again
    assert "epoch 3:" not in again and "resumed from" not in again


def test_dcgan_resume_says_where_it_continues(tmp_path, capsys):
    argv = ["--synthetic", "--synthetic-size", 30, "--image-size", 8, "--ngf", 4, "--ndf", 4, "--nz", 8,
            "--sigma", SIGMA, "--batch-size", 10, "--outf", tmp_path, "--no-progress"]
    run_example("dcgan", [*argv, "--epochs", 1], capsys)
    out = run_example("dcgan", [*argv, "--epochs", 2, "--resume", tmp_path / "dcgan.pt"], capsys)
    assert re.search(rf"resumed from {re.escape(str(tmp_path / 'dcgan.pt'))} at step 3 \(ε = [0-9.]+\)", out)


# ------------------------------------------------------------------------ output locations
def test_default_run_leaves_the_working_tree_clean(tmp_path, monkeypatch, capsys):
    work, cache = tmp_path / "checkout", tmp_path / "cache"
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    run_example("cifar10", [*TINY_CIFAR, "--epochs", 1, "--no-progress"], capsys)
    run_example("dcgan", ["--synthetic", "--synthetic-size", 30, "--image-size", 8, "--ngf", 4, "--ndf", 4,
                          "--nz", 8, "--batch-size", 10, "--epochs", 1, "--no-progress"], capsys)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=work,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", status
    outputs = cache / "opacus_dp" / "examples"
    assert (outputs / "cifar10" / "cifar10.pt").is_file()
    assert (outputs / "dcgan" / "dcgan.pt").is_file() and (outputs / "dcgan" / "real_samples.png").is_file()


@pytest.mark.parametrize("name", ["cifar10", "mnist", "char_lstm", "dcgan", "finetune_transformer"])
def test_default_outputs_lie_outside_the_repository(name, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.chdir(EXAMPLES.parent)  # the repository root, where the README runs the examples
    args = example_module(name).parse_args(["--synthetic"] if name != "finetune_transformer" else [])
    path = os.path.abspath(args.checkpoint_file)
    assert not path.startswith(str(EXAMPLES.parent) + os.sep), path
    assert path.startswith(os.path.join(os.path.expanduser("~"), ".cache", "opacus_dp", "examples")), path


# ------------------------------------------------------------------------ --help
@pytest.mark.parametrize("name", ["cifar10", "mnist", "char_lstm", "dcgan", "finetune_transformer",
                                  "fsdp_finetune", "quickstart"])
def test_help_states_each_default_once(name, capsys):
    module = example_module(name)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text
    assert "(default: 0)" in text  # --seed: a default nobody states in words is still shown
    # A help text that states its default in words gets no second "(default: ...)".
    for stated in re.findall(r"(?:None: |default )[^-]*?(?=  |--|$)", text):
        assert "(default:" not in stated, stated


# ------------------------------------------------------------------------ secure mode notice
def test_secure_mode_notice_is_one_clean_line(tmp_path, capsys):
    argv = [*TINY_CIFAR, "--epochs", 1, "--checkpoint-file", tmp_path / "c.pt", "--no-progress"]
    _, err = _run_with_stderr("cifar10", argv, capsys)
    lines = [line for line in err.splitlines() if "secure" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("note: secure_mode is off") and "--secure-rng" in lines[0]
    assert "Warning" not in err and ".py:" not in err, err


def test_secure_rng_run_prints_no_notice(tmp_path, capsys):
    argv = [*TINY_CIFAR, "--epochs", 1, "--checkpoint-file", tmp_path / "c.pt", "--no-progress", "--secure-rng"]
    _, err = _run_with_stderr("cifar10", argv, capsys)
    assert "secure" not in err, err

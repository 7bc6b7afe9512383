"""A save that dies part-way never destroys the previous checkpoint.

Oracle: the state of the first save, written aside with plain ``torch.save``; after the second
save is killed (SIGKILL while it writes) or fails (an OSError while it writes), the checkpoint
file must still load and equal that state.
"""

import io
import os
import selectors
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.review.helpers import make_private, tiny_model, train

KEY = b"0123456789abcdef-user-held-key"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_TIMEOUT_S = 120

_CHILD = textwrap.dedent("""
    import io, os, sys, time, warnings
    import torch
    sys.path.insert(0, {root!r})
    from tests.review.helpers import make_private, tiny_model, train
    path, oracle, key = sys.argv[1], sys.argv[2], (sys.argv[3].encode() or None)
    engine, gsm, optimizer, loader = make_private(tiny_model(0))
    train(gsm, optimizer, loader, 3)
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=key)
    torch.save({{"params": [p.detach().clone() for p in gsm.parameters()],
                "history": list(engine.accountant.history)}}, oracle)
    train(gsm, optimizer, loader, 2)
    real_save = torch.save

    def dies_while_writing(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        handle = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        handle.write(data[: len(data) // 2])
        handle.flush()
        print("WRITING", flush=True)
        time.sleep({timeout})

    torch.save = dies_while_writing
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=key)
""")


def _wait_for_line(proc, expected: str, timeout: float) -> None:
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        proc.kill()
        raise TimeoutError(f"the saving process did not reach the write within {timeout} s")
    line = proc.stdout.readline()
    if line.strip() != expected:
        proc.kill()
        raise AssertionError(f"saving process said {line!r}; stderr: {proc.stderr.read()}")


def _assert_loads_as(path, oracle_path, signing_key):
    oracle = torch.load(oracle_path, weights_only=True)
    engine, gsm, optimizer, _ = make_private(tiny_model(seed=5))
    engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=signing_key)
    for p, expected in zip(gsm.parameters(), oracle["params"]):
        assert torch.equal(p.detach(), expected)
    assert engine.accountant.history == [tuple(h) for h in oracle["history"]]
    assert optimizer.steps_taken == 3


@pytest.mark.parametrize("signed", [False, True])
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, signed):
    path, oracle = tmp_path / "run.pt", tmp_path / "oracle.pt"
    script = _CHILD.format(root=ROOT, timeout=CHILD_TIMEOUT_S)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(oracle), KEY.decode() if signed else ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        _wait_for_line(proc, "WRITING", CHILD_TIMEOUT_S)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    _assert_loads_as(path, oracle, KEY if signed else None)


@pytest.mark.parametrize("signed", [False, True])
def test_a_save_that_fails_while_writing_leaves_the_previous_checkpoint_and_no_debris(tmp_path, monkeypatch, signed):
    key = KEY if signed else None
    engine, gsm, optimizer, loader = make_private(tiny_model(0))
    train(gsm, optimizer, loader, 3)
    path, oracle = tmp_path / "run.pt", tmp_path / "oracle.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=key)
    torch.save({"params": [p.detach().clone() for p in gsm.parameters()],
                "history": list(engine.accountant.history)}, oracle)
    train(gsm, optimizer, loader, 2)
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        handle = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        handle.write(buffer.getvalue()[:100])
        handle.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, signing_key=key)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(os.listdir(tmp_path)) == ["oracle.pt", "run.pt"]
    _assert_loads_as(path, oracle, key)


def test_the_new_file_is_synced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    engine, gsm, optimizer, _ = make_private(tiny_model(0))
    path = tmp_path / "run.pt"
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.path.dirname(a))),
                                                     real_replace(a, b))[1])
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    assert events[0] == "fsync" and events[1] == ("replace", str(tmp_path))
    assert os.listdir(tmp_path) == ["run.pt"]


def test_the_checkpoint_gets_the_mode_a_plainly_created_file_gets(tmp_path):
    """The temporary file is created with the umask applied, as ``open(path, "w")`` would."""
    engine, gsm, optimizer, _ = make_private(tiny_model(0))
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    assert os.stat(path).st_mode == os.stat(reference).st_mode

"""One-process checks of the FSDP2 checkpoint directory's parts: each rank's own checks of its
file (on files written here by hand), the verdict every rank raises, and the directory swap
after a crash at each point of it."""

import os

import pytest

from opacus_dp.checkpoints import file_format
from opacus_dp.accountants import RDPAccountant
from opacus_dp.checkpoints import directory as sharded_directory
from opacus_dp.checkpoints.agreement import RankStatus, Refusal, agree
from opacus_dp.checkpoints.sharded import (
    ShardedCheckpointError,
    ShardedCheckpointIntegrityError,
    check_rank_file,
)

KEY = b"0123456789abcdef-units"


def history(steps: int) -> dict:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    return accountant.state_dict()


def write_rank_file(directory, file_rank=0, *, recorded=3, key=KEY, **changes):
    """``private_rank{file_rank}.pt`` as rank ``file_rank`` of 2 writes it after 3 steps, but for
    ``changes`` to its entries."""
    os.makedirs(os.path.join(directory, "sharded"), exist_ok=True)
    state = {"privacy_accountant_state_dict": history(recorded), "dp_optimizer_steps": 3,
             "world_size": 2, "rank": file_rank}
    state.update(changes)
    file_format.write(state, os.path.join(directory, f"private_rank{file_rank}.pt"), signing_key=key)


def check(directory, rank=0, world_size=2, key=KEY):
    return check_rank_file(str(directory), rank, world_size, RDPAccountant(), signing_key=key)


def test_a_valid_file_is_ready_with_its_steps_and_history_digest(tmp_path):
    write_rank_file(tmp_path, 0)
    write_rank_file(tmp_path / "other", 1)
    status, state, error = check(tmp_path)
    assert status.reason is None and error is None and status.steps == 3
    assert "world_size" not in state and "rank" not in state
    assert check(tmp_path / "other", rank=1)[0].digest == status.digest  # same history, same digest
    write_rank_file(tmp_path / "longer", 0, recorded=4)
    assert check(tmp_path / "longer")[0].digest != status.digest


@pytest.mark.parametrize("changes,reason,detail", [
    ({"world_size": 4}, Refusal.WORLD_SIZE, 4),
    ({"rank": 1}, Refusal.WRONG_RANK, 1),  # rank 1's file under rank 0's name
    ({"dp_optimizer_steps": 3.0}, Refusal.MALFORMED, 0),  # a float counter is not a count
    ({"dp_optimizer_steps": True}, Refusal.MALFORMED, 0),
    ({"dp_optimizer_steps": -1}, Refusal.MALFORMED, 0),
    ({"world_size": "2"}, Refusal.MALFORMED, 0),
    ({"rank": 2}, Refusal.MALFORMED, 0),  # not below the world size it names
    ({"dp_optimizer_steps": 5}, Refusal.HISTORY, 0),  # more steps than the history records
])
def test_each_rank_refuses_its_own_file_with_a_typed_reason(tmp_path, changes, reason, detail):
    write_rank_file(tmp_path, 0, **changes)
    status, state, _ = check(tmp_path)
    assert (status.reason, status.detail, state) == (reason, detail, None)


def test_missing_damaged_and_unsigned_files(tmp_path):
    assert check(tmp_path)[0].reason is Refusal.NOT_A_CHECKPOINT
    os.makedirs(tmp_path / "sharded")
    assert check(tmp_path)[0].reason is Refusal.MISSING_FILE
    (tmp_path / "private_rank0.pt").write_bytes(b"not a checkpoint")
    assert check(tmp_path)[0].reason in (Refusal.UNREADABLE, Refusal.SIGNATURE)
    write_rank_file(tmp_path, 0, key=None)
    status, _, error = check(tmp_path)
    assert status.reason is Refusal.SIGNATURE and isinstance(error, file_format.CheckpointIntegrityError)
    assert check(tmp_path, key=None)[0].reason is None


def test_every_rank_raises_the_verdict_of_the_table(group, tmp_path):
    with pytest.raises(ShardedCheckpointError) as raised:
        agree(tmp_path, RankStatus(Refusal.WORLD_SIZE, detail=4), action="load", rank=0, world_size=1)
    assert raised.value.refusals == {0: Refusal.WORLD_SIZE}
    assert "private_rank0.pt was written by a run of 4 processes, not the 1 running now" in str(raised.value)
    with pytest.raises(ShardedCheckpointIntegrityError) as raised:
        agree(tmp_path, RankStatus(Refusal.SIGNATURE), action="load", rank=0, world_size=1)
    assert isinstance(raised.value, file_format.CheckpointIntegrityError)
    assert [s.steps for s in agree(tmp_path, RankStatus(steps=7), action="load", rank=0, world_size=1)] == [7]


def _tree(path):
    return {name: (path / name).read_text() for name in sorted(os.listdir(path))}


def test_the_swap_replaces_the_directory_only_when_complete(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "private_rank0.pt").write_text("old")
    staging = sharded_directory.prepare(path)
    assert os.listdir(staging) == [] and _tree(path) == {"private_rank0.pt": "old"}
    (tmp_path / ".ckpt.saving" / "private_rank0.pt").write_text("new")
    sharded_directory.swap_into_place(path)
    assert _tree(path) == {"private_rank0.pt": "new"} and sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("crash_after", ["staging", "first_rename", "second_rename"])
def test_a_save_interrupted_anywhere_leaves_one_whole_checkpoint(tmp_path, crash_after):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "private_rank0.pt").write_text("old")
    sharded_directory.prepare(path)
    (tmp_path / ".ckpt.saving" / "private_rank0.pt").write_text("new")
    if crash_after in ("first_rename", "second_rename"):
        os.rename(path, tmp_path / ".ckpt.previous")
    if crash_after == "second_rename":
        os.rename(tmp_path / ".ckpt.saving", path)
    sharded_directory.prepare(path)  # the next save starts by tidying up
    assert _tree(path) == {"private_rank0.pt": "new" if crash_after == "second_rename" else "old"}
    assert sorted(os.listdir(tmp_path)) == [".ckpt.saving", "ckpt"]


def test_a_path_holding_anything_else_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "ckpt").write_text("a single-file checkpoint")
    with pytest.raises(sharded_directory.PathInUseError, match="choose another path"):
        sharded_directory.prepare(tmp_path / "ckpt")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(sharded_directory.PathInUseError, match=r"\(notes.txt\).*directory of its own"):
        sharded_directory.prepare(tmp_path / "run")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "run"]
    for name in ("sharded", "private_rank0.pt", "private_rank12.pt", ".private_rank1.pt.x1y2.tmp"):
        (tmp_path / "ours").mkdir(exist_ok=True)
        (tmp_path / "ours" / name).write_text("")
    sharded_directory.prepare(tmp_path / "ours")  # an empty directory or a checkpoint: replaced

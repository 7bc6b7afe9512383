"""Replacing a sharded checkpoint directory atomically: a crash mid-save keeps the previous one.

A save writes every rank's part into the staging sibling ``.NAME.saving`` (beside ``path``,
so on the same file system); only once every rank has written its part does rank 0 swap it in:

1. ``path`` → ``.NAME.previous`` (when a previous checkpoint exists),
2. ``.NAME.saving`` → ``path``,
3. remove ``.NAME.previous``.

Each step is one ``os.rename`` (atomic on POSIX file systems). A crash before step 1 leaves
``path`` as it was (the next save removes the stale staging directory); a crash between steps 1
and 2 leaves the previous checkpoint whole at ``.NAME.previous``, which the next save puts back
first (:func:`prepare`) and a load names in its error; a crash after step 2 leaves the new one.
As a save replaces the whole directory, :func:`prepare` refuses a ``path`` that is a file or
holds anything a save did not write (:class:`PathInUseError`).
"""

import os
import re
import shutil

_OURS = re.compile(r"(sharded|\.?private_rank\d+\.pt.*)")  # what a save writes (and its temporary files)


class PathInUseError(ValueError):
    """``path`` holds something a sharded checkpoint did not write, which a save would replace."""


def _sibling(path, suffix: str) -> str:
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(parent, f".{name}.{suffix}")


def staging_path(path) -> str:
    """Where a save writes before it is swapped in."""
    return _sibling(path, "saving")


def previous_path(path) -> str:
    """Where the previous checkpoint waits while the new one is moved into place."""
    return _sibling(path, "previous")


def prepare(path) -> str:
    """Rank 0, before any rank writes: restore a previous checkpoint an interrupted swap left
    aside, remove stale staging, create an empty staging directory; returns its path."""
    path, previous, staging = os.path.abspath(os.fspath(path)), previous_path(path), staging_path(path)
    _check_replaceable(path)
    if os.path.isdir(previous):
        if os.path.exists(path):  # the crash came after step 2: the new one is complete
            shutil.rmtree(previous)
        else:
            os.rename(previous, path)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def _check_replaceable(path: str) -> None:
    """A save replaces the whole directory: refuse one that holds anything else."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise PathInUseError(f"{path} exists and is not a directory: a sharded checkpoint is a directory; "
                             "choose another path (nothing was written)")
    foreign = sorted(name for name in os.listdir(path) if not _OURS.fullmatch(name)) if os.path.isdir(path) else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise PathInUseError(f"{path} holds files a sharded checkpoint did not write ({shown}), which saving "
                             "would delete: a save replaces the whole directory. Save into a directory of "
                             "its own (nothing was written)")


def swap_into_place(path) -> None:
    """Rank 0, once every rank wrote its part: the three steps of the module doc."""
    path, previous, staging = os.path.abspath(os.fspath(path)), previous_path(path), staging_path(path)
    if os.path.exists(path):
        os.rename(path, previous)
    os.rename(staging, path)
    if os.path.isdir(previous):
        shutil.rmtree(previous)


def discard_staging(path) -> None:
    """Rank 0, after a failed save: remove what it wrote (the previous checkpoint stays)."""
    shutil.rmtree(staging_path(path), ignore_errors=True)

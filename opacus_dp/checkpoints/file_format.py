"""The checkpoint file: written atomically, only with what torch's safe loader reads, read
safely, optionally signed.

* **Safe by default.** :func:`read` calls ``torch.load(..., weights_only=True)``: tensors,
  containers and plain Python values are rebuilt, and a pickled object that would run code on
  loading (a ``__reduce__`` naming ``os.system``, ...) is refused *before* it is called.
  ``torch_load_kwargs={"weights_only": False}`` is the explicit opt-out for old files from a
  trusted source. :func:`write` refuses, before writing anything, an entry the safe loader could
  not read back (a numpy scalar, an argparse ``Namespace``, ...), naming it.
* **Atomic writes.** :func:`write` writes a temporary file in the target's directory, flushes and
  ``fsync`` s it, then ``os.replace`` s the target (and syncs the directory): a save that dies
  part-way leaves the previous checkpoint whole (at worst a ``.<name>.*.tmp`` file behind).
* **Integrity, optional.** ``signing_key`` signs the file with HMAC-SHA256 (RFC 2104). A signed
  file is ``MAGIC ‖ mac ‖ payload``: ``payload`` is the ``torch.save`` bytes of the checkpoint and
  ``mac = HMAC(key, DOMAIN ‖ payload)`` (32 raw bytes). Reading with the key checks the MAC over
  these raw bytes *before anything is unpickled*, whatever ``torch_load_kwargs`` say, and refuses
  an unsigned file, an altered one, and the earlier signed layout (a torch archive holding payload
  and MAC, which cannot be checked without unpickling). The key is never written.
* **Damaged files** (truncated, corrupted, not a torch file) raise a ``ValueError`` that names the
  file, instead of the archive reader's low-level error.
"""

import collections
import contextlib
import hashlib
import hmac
import io
import os
import pickle
import re
import secrets
import warnings
import zipfile
from typing import Any, Callable, Optional, Union

import torch

SIGNED_MAGIC = b"\x89opacus_dp signed checkpoint v2\n"  # not a zip ("PK") nor a pickle (0x80)
SIGNED_FORMAT = "opacus_dp_signed_checkpoint"  # the key of the earlier signed layout (read without a key only)
_DOMAIN = b"opacus_dp checkpoint v2\x00"
_MAC_BYTES = hashlib.sha256().digest_size
_MIN_KEY_BYTES = 16
_PLAIN_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device,
                 torch.layout, torch.memory_format, slice)
_CONTAINERS = (dict, list, tuple, set, frozenset)


class CheckpointIntegrityError(ValueError):
    """A checkpoint whose signature does not verify, whose integrity fields are malformed, or
    whose privacy history contradicts the rest of the file; nothing was loaded."""


def key_bytes(signing_key: Union[bytes, str]) -> bytes:
    """``signing_key`` as bytes (a str is UTF-8 encoded); at least 16 bytes."""
    if isinstance(signing_key, str):
        signing_key = signing_key.encode("utf-8")
    if not isinstance(signing_key, (bytes, bytearray)):
        raise TypeError(f"signing_key must be bytes or str, got {type(signing_key).__name__}")
    if len(signing_key) < _MIN_KEY_BYTES:
        raise ValueError(f"signing_key has {len(signing_key)} bytes; use at least {_MIN_KEY_BYTES} "
                         "(e.g. secrets.token_bytes(32), kept outside the checkpoint)")
    return bytes(signing_key)


def _mac(key: bytes, payload) -> bytes:
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


# ----------------------------------------------------------------------------- writing
def check_safe_entries(state: Any, where: str = "checkpoint") -> None:
    """Raise a TypeError naming the first entry of ``state`` that ``torch.load(weights_only=True)``
    could not rebuild; such an entry would make the file unreadable without the unsafe loader.
    Types are compared exactly: a numpy float is a ``float`` subclass, but not loadable."""
    kind = type(state)
    if kind in _PLAIN_LEAVES or kind in (torch.Tensor, torch.nn.Parameter):
        return
    if kind in _CONTAINERS or kind is collections.OrderedDict:
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            if isinstance(state, dict):
                check_safe_entries(key, f"a key of {where}")
            check_safe_entries(value, f"{where}[{key!r}]")
        return
    if _unsafe_globals(state):
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) "
            "cannot read back (only the unsafe loader, which can run code, could): store it as tensors "
            "or plain Python values (float(x), int(x), list(...), vars(namespace)); nothing was written")


def _unsafe_globals(value: Any) -> list:
    """The globals a pickle of ``value`` needs that the safe loader does not allow."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    if hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
        return torch.serialization.get_unsafe_globals_in_checkpoint(buffer)
    try:  # torch < 2.5
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        return [str(error)]
    return []


def write(state: dict, path, *, signing_key=None, torch_save_kwargs: Optional[dict] = None) -> None:
    """Write ``state`` to ``path`` atomically after checking every entry
    (:func:`check_safe_entries`); signed when ``signing_key`` is given (module doc)."""
    check_safe_entries(state)
    kwargs = dict(torch_save_kwargs or {})
    if signing_key is None:
        write_atomically(path, lambda handle: torch.save(state, handle, **kwargs))
        return
    key = key_bytes(signing_key)
    buffer = io.BytesIO()
    torch.save(state, buffer, **kwargs)
    payload = buffer.getbuffer()

    def fill(handle) -> None:
        handle.write(SIGNED_MAGIC)
        handle.write(_mac(key, payload))
        handle.write(payload)

    write_atomically(path, fill)


def write_atomically(path, fill: Callable[[Any], None]) -> None:
    """``fill(handle)`` into a temporary file next to ``path``, flushed and fsynced, then moved
    over ``path`` with ``os.replace`` (atomic on POSIX and Windows): ``path`` holds the old file
    or the new one, never a part. A file object given as ``path`` is written in place."""
    if not isinstance(path, (str, os.PathLike)):
        fill(path)
        return
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = _create_temporary(directory, os.path.basename(path))
    try:
        with os.fdopen(descriptor, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_directory(directory)


def _create_temporary(directory: str, name: str):
    """A new file ``.NAME.<random>.tmp`` in ``directory``, created exclusively with the mode
    ``open(path, "w")`` would give (0o666 less the umask, applied by the system)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {os.path.join(directory, name)}")


def _sync_directory(directory: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ----------------------------------------------------------------------------- reading
def read(path, *, signing_key=None, map_location=None, torch_load_kwargs: Optional[dict] = None) -> dict:
    """The checkpoint dict at ``path``, loaded safely (module doc); with ``signing_key`` its MAC is
    verified on the raw bytes before anything is unpickled. Raises before anything is returned
    if the file is damaged, unsafe or unverified."""
    kwargs = dict(torch_load_kwargs or {})
    kwargs.setdefault("weights_only", True)
    if map_location is not None:
        kwargs["map_location"] = map_location
    key = None if signing_key is None else key_bytes(signing_key)
    with _opened(path) as (source, start):
        signed = source.read(len(SIGNED_MAGIC)) == SIGNED_MAGIC
        body = source.read() if signed else None
        if not signed and key is not None:
            raise _unsigned(path, source, start)
        if not signed and not isinstance(path, (str, os.PathLike)):
            source.seek(start)
    if signed:
        state = _load(io.BytesIO(_verified_payload(path, body, key)), path, _warned(path, kwargs))
    else:
        state = _load(path, path, _warned(path, kwargs))
        if isinstance(state, dict) and SIGNED_FORMAT in state:
            state = _open_earlier_envelope(path, state, kwargs)
    _check_is_dict(path, state)
    return state


@contextlib.contextmanager
def _opened(path):
    """``(binary file object, start offset)`` of ``path`` (a path, or a file object given as such)."""
    if not isinstance(path, (str, os.PathLike)):
        yield path, path.tell()
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    with open(path, "rb") as handle:
        yield handle, 0


def _warned(path, kwargs: dict) -> dict:
    if not kwargs["weights_only"]:
        warnings.warn(f"loading checkpoint {path} with weights_only=False: any code pickled in the "
                      "file runs now; do this only for a file you wrote yourself", UserWarning)
    return kwargs


def _verified_payload(path, body: bytes, key: Optional[bytes]) -> bytes:
    """The payload of a signed file's ``mac ‖ payload``, its MAC checked when a key is given."""
    mac, payload = body[:_MAC_BYTES], memoryview(body)[_MAC_BYTES:]
    if key is None:
        warnings.warn(f"checkpoint {path} is signed but no signing_key was given: its integrity was "
                      "NOT checked; pass signing_key= to verify it", UserWarning)
    elif len(mac) < _MAC_BYTES or not hmac.compare_digest(mac, _mac(key, payload)):
        raise CheckpointIntegrityError(
            f"checkpoint {path}: its signature does not verify with this signing_key (the file was "
            "changed after it was written, or signed with another key); nothing was unpickled or loaded")
    return payload


def _unsigned(path, source, start: int) -> CheckpointIntegrityError:
    """The refusal of a file without the signed header, read with a key (nothing unpickled)."""
    if _holds_earlier_envelope(source, start):
        return CheckpointIntegrityError(
            f"checkpoint {path} is in the earlier signed format of opacus_dp, whose signature can only "
            "be checked after unpickling part of the file, which is never done with a signing_key; "
            "nothing was loaded. To carry it over, load a copy you trust once without signing_key "
            "(safe loading, weights_only=True), then save_checkpoint(..., signing_key=...) to sign it "
            "in the current format")
    return CheckpointIntegrityError(
        f"checkpoint {path} is not signed, but a signing_key was given: it cannot be verified "
        "(nothing was unpickled or loaded). Load it without signing_key only if you trust where it "
        "came from")


def _holds_earlier_envelope(source, start: int) -> bool:
    """Whether the torch archive's pickle names the earlier envelope key (its bytes are searched,
    never unpickled)."""
    try:
        source.seek(start)
        with zipfile.ZipFile(source) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("data.pkl")]
            return any(SIGNED_FORMAT.encode() in archive.read(name) for name in pickles[:1])
    except (zipfile.BadZipFile, OSError, ValueError, KeyError):
        return False


def _open_earlier_envelope(path, envelope: dict, kwargs: dict) -> dict:
    """The payload of the earlier signed layout, read without a key (so not verified, with a warning)."""
    if envelope.get(SIGNED_FORMAT) != 1 or not isinstance(envelope.get("payload"), torch.Tensor):
        raise ValueError(f"checkpoint {path}: unknown signed-checkpoint format {envelope.get(SIGNED_FORMAT)!r}")
    warnings.warn(f"checkpoint {path} is signed (earlier format) but no signing_key was given: its "
                  "integrity was NOT checked; save it again with signing_key= to sign it in the current "
                  "format", UserWarning)
    return _load(io.BytesIO(envelope["payload"].cpu().numpy().tobytes()), path, kwargs)


def _load(source, path, kwargs: dict):
    try:
        return torch.load(source, **kwargs)
    except pickle.UnpicklingError as error:
        blocked = re.search(r"GLOBAL\s+([\w.]+)", str(error))
        if kwargs.get("weights_only") and blocked:
            raise pickle.UnpicklingError(
                f"checkpoint {path} holds an object ({blocked.group(1)}) that torch's safe loader refuses, "
                "as unpickling it could run code, so nothing was loaded. If you wrote this file yourself "
                "with an older version and trust it, pass torch_load_kwargs={'weights_only': False}"
            ) from error
        raise _damaged(path, error) from error
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
        raise _damaged(path, error) from error


def _damaged(path, error: BaseException) -> ValueError:
    return ValueError(f"checkpoint {path} is corrupt or truncated and cannot be read (an incomplete "
                      f"copy or an interrupted save?); nothing was loaded. Reader's error: "
                      f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def _check_is_dict(path, state) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, not the dict that "
                         "save_checkpoint writes; nothing was loaded")

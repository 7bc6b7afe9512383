"""The checkpoint file: written only with what torch's safe loader reads, read safely, optionally
signed.

* **Safe by default.** :func:`read` calls ``torch.load(..., weights_only=True)``: tensors,
  containers and plain Python values are rebuilt, and a pickled object that would run code on
  loading (a ``__reduce__`` naming ``os.system``, ...) is refused *before* it is called.
  ``torch_load_kwargs={"weights_only": False}`` is the explicit opt-out for old files from a
  trusted source. :func:`write` refuses, before writing anything, an entry the safe loader could
  not read back (a numpy scalar, an argparse ``Namespace``, ...), naming it.
* **Integrity, optional.** ``signing_key`` adds an HMAC-SHA256 (RFC 2104) over the serialised
  contents: the file holds ``{SIGNED_FORMAT: version, "payload": uint8 tensor, "mac": hex}``, where
  ``payload`` is the ``torch.save`` bytes of the checkpoint, and the MAC is
  ``HMAC(key, DOMAIN ‖ payload)``. Reading with the key refuses a file whose MAC does not
  verify, or that is not signed. The key is never written.
* **Damaged files** (truncated, corrupted, not a torch file) raise a ``ValueError`` that names the
  file, instead of the archive reader's low-level error.
"""

import collections
import hashlib
import hmac
import io
import os
import pickle
import re
import warnings
import zipfile
from typing import Any, Optional, Union

import torch

SIGNED_FORMAT = "opacus_dp_signed_checkpoint"
_VERSION = 1
_DOMAIN = b"opacus_dp checkpoint v1\x00"
_MIN_KEY_BYTES = 16
_PLAIN_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device,
                 torch.layout, torch.memory_format, slice)
_CONTAINERS = (dict, list, tuple, set, frozenset)


class CheckpointIntegrityError(ValueError):
    """A checkpoint whose signature does not verify, or whose privacy history contradicts the
    rest of the file; nothing was loaded."""


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


def _mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, _DOMAIN + payload, hashlib.sha256).hexdigest()


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
    """Write ``state`` to ``path`` after checking every entry (:func:`check_safe_entries`); signed
    when ``signing_key`` is given (module doc)."""
    check_safe_entries(state)
    kwargs = dict(torch_save_kwargs or {})
    if signing_key is None:
        torch.save(state, path, **kwargs)
        return
    key = key_bytes(signing_key)
    buffer = io.BytesIO()
    torch.save(state, buffer, **kwargs)
    payload = buffer.getvalue()
    envelope = {SIGNED_FORMAT: _VERSION, "mac": _mac(key, payload),
                "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}
    torch.save(envelope, path, **kwargs)


# ----------------------------------------------------------------------------- reading
def read(path, *, signing_key=None, map_location=None, torch_load_kwargs: Optional[dict] = None) -> dict:
    """The checkpoint dict at ``path``, loaded safely (module doc); verified when ``signing_key``
    is given. Raises before anything is returned if the file is damaged, unsafe or unverified."""
    kwargs = dict(torch_load_kwargs or {})
    kwargs.setdefault("weights_only", True)
    if not kwargs["weights_only"]:
        warnings.warn(f"loading checkpoint {path} with weights_only=False: any code pickled in the "
                      "file runs now; do this only for a file you wrote yourself", UserWarning)
    if map_location is not None:
        kwargs["map_location"] = map_location
    state = _load(path, path, kwargs)
    if isinstance(state, dict) and SIGNED_FORMAT in state:
        return _open_envelope(path, state, signing_key, kwargs)
    if signing_key is not None:
        raise CheckpointIntegrityError(
            f"checkpoint {path} is not signed, but a signing_key was given: it cannot be verified "
            "(nothing was loaded). Load it without signing_key only if you trust where it came from")
    _check_is_dict(path, state)
    return state


def _open_envelope(path, envelope: dict, signing_key, kwargs: dict) -> dict:
    if envelope.get(SIGNED_FORMAT) != _VERSION or not isinstance(envelope.get("payload"), torch.Tensor):
        raise ValueError(f"checkpoint {path}: unknown signed-checkpoint format {envelope.get(SIGNED_FORMAT)!r}")
    payload = envelope["payload"].cpu().numpy().tobytes()
    if signing_key is None:
        warnings.warn(f"checkpoint {path} is signed but no signing_key was given: its integrity was "
                      "NOT checked; pass signing_key= to verify it", UserWarning)
    elif not hmac.compare_digest(str(envelope.get("mac")), _mac(key_bytes(signing_key), payload)):
        raise CheckpointIntegrityError(
            f"checkpoint {path}: its signature does not verify with this signing_key (the file was "
            "changed after it was written, or signed with another key); nothing was loaded")
    state = _load(io.BytesIO(payload), path, kwargs)
    _check_is_dict(path, state)
    return state


def _load(source, path, kwargs: dict):
    if isinstance(source, (str, os.PathLike)) and not os.path.isfile(source):
        raise FileNotFoundError(f"checkpoint {path}: no such file")
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

"""The native Philox kernel (``kernel.c``): compiled once per machine kind, loaded with ctypes.

The C file is compiled by ``$CC`` (default ``cc``) with ``-O3 -ffp-contract=off -fno-math-errno
-fopenmp-simd`` and, on x86-64, the instruction level torch detected
(``torch.backends.cpu.get_cpu_capability()``: AVX512 → ``x86-64-v4``, AVX2 → ``x86-64-v3``), into a
private cache directory (``$OPACUS_DP_CACHE``, else ``$XDG_CACHE_HOME/opacus_dp`` or
``~/.cache/opacus_dp``; a directory another user owns or can write is not used), the file named by
the hash of source, compiler and flags (written under a temporary name, then renamed: ranks that
compile at once do not clash). Every build gives the same bits (``kernel.c``'s header).

``OPACUS_DP_NATIVE=0`` turns the kernel off. Without it (no compiler, a failed build), the noise is
computed by the torch reference (:mod:`~opacus_dp.optim.philox.reference`): the same numbers,
slower; :func:`unavailable_reason` says why.
"""

import ctypes
import hashlib
import os
import platform
import shlex
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

SOURCE = Path(__file__).with_name("kernel.c")
KERNEL_VERSION = 3
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd")
_X86_LEVELS = {"AVX512": "-march=x86-64-v4", "AVX2": "-march=x86-64-v3"}
_lock = threading.Lock()
_loaded: Optional[Tuple[Optional[Callable], Optional[str]]] = None


def compile_flags() -> List[str]:
    """The compiler's flags for this machine (module doc)."""
    flags = list(BASE_FLAGS)
    if platform.machine().lower() in ("x86_64", "amd64"):
        level = _X86_LEVELS.get(torch.backends.cpu.get_cpu_capability())
        flags.append(level or "-march=x86-64")
    return flags


def cache_directory() -> Path:
    """The private directory the compiled kernel is kept in (module doc); a new temporary one
    when the configured one is not private to this user."""
    configured = os.environ.get("OPACUS_DP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "opacus_dp")
    directory = Path(configured) / "native"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = directory.stat()
    except OSError:
        info = None
    if info is not None and info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return directory
    return Path(tempfile.mkdtemp(prefix="opacus_dp_native_"))


def build(compiler: Optional[str] = None, flags: Optional[List[str]] = None, directory: Optional[Path] = None) -> Path:
    """The shared library of ``kernel.c`` (compiled unless already cached). Raises ``RuntimeError``
    naming the command and its output when the compiler fails."""
    command = shlex.split(compiler or os.environ.get("CC") or "cc")
    flags = compile_flags() if flags is None else list(flags)
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join(command + flags).encode()).hexdigest()[:24]
    directory = cache_directory() if directory is None else Path(directory)
    target = directory / f"philox_v{KERNEL_VERSION}_{digest}.so"
    if target.exists():
        return target
    partial = directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    argv = command + flags + [str(SOURCE), "-o", str(partial)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"cannot run the C compiler ({' '.join(argv)}): {error}") from error
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"the C compiler failed ({' '.join(argv)}):\n{done.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


_STREAM_ARGUMENTS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint32,
                     ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_float, ctypes.c_float]


def load(path: Path) -> Callable:
    """The kernel function of the library at ``path`` (its version checked):
    ``kernel(out, base, start, count, k0, k1, c2, c3, std, divisor)``; its form on a team of
    OpenMP threads as ``kernel.parallel(gomp_parallel, threads, chunk, out, base, start, ...)``,
    which returns its chunk counter (at least ``count`` once the team ran; ``kernel.c``)."""
    library = ctypes.CDLL(str(path))
    if library.opacus_dp_philox_version() != KERNEL_VERSION:
        raise RuntimeError(f"{path} is not version {KERNEL_VERSION} of the Philox kernel")
    kernel = library.opacus_dp_philox_normal
    kernel.argtypes, kernel.restype = _STREAM_ARGUMENTS, None
    parallel = library.opacus_dp_philox_normal_parallel
    parallel.argtypes, parallel.restype = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_int64] + _STREAM_ARGUMENTS, ctypes.c_int64
    kernel.parallel = parallel
    return kernel


def kernel() -> Optional[Callable]:
    """The loaded kernel (built on first use, once per process), or None (:func:`unavailable_reason`)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _try_load()
        return _loaded[0]


def unavailable_reason() -> Optional[str]:
    """Why the kernel is not used (None when it is)."""
    kernel()
    return "the kernel was not loaded" if _loaded is None else _loaded[1]


def forget() -> None:
    """Load again at the next :func:`kernel` (after the environment changed)."""
    global _loaded
    with _lock:
        _loaded = None


def _try_load() -> Tuple[Optional[Callable], Optional[str]]:
    """The kernel built for this machine's instruction level, else for the baseline (a compiler
    that does not know the level's name), else None and why."""
    if os.environ.get("OPACUS_DP_NATIVE", "1") == "0":
        return None, "OPACUS_DP_NATIVE=0"
    reasons = []
    for flags in _unique([compile_flags(), list(BASE_FLAGS)]):
        try:
            return load(build(flags=flags)), None
        except (RuntimeError, OSError, AttributeError) as error:
            reasons.append(str(error))
    return None, "; ".join(reasons)


def _unique(candidates: List[List[str]]) -> List[List[str]]:
    return [c for i, c in enumerate(candidates) if c not in candidates[:i]]

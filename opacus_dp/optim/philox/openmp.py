"""torch's own OpenMP threads for the noise kernel: ``GOMP_parallel`` of the libgomp torch runs on.

After an operation on several threads, libgomp's threads keep spinning for a while (its default
wait policy) before they sleep. Threads of our own drawing the noise then share the cores with
them: on two cores the noise of a step right after the backward pass took about 10 ms instead of
6. Run on torch's team instead (the spinning threads take the work at once), the kernel's chunks
are drawn by the threads torch's next operation would use anyway.

Found only where it is unambiguous: torch's parallel backend is OpenMP and exactly the libgomp in
torch's own ``lib`` directory, else the only libgomp, is mapped into the process (Linux,
``/proc/self/maps``), opened again without loading anything (``RTLD_NOLOAD``). Elsewhere (another
OpenMP runtime, macOS, Windows) :func:`gomp_parallel` is None and the noise uses its thread pool.
``OPACUS_DP_NOISE_OPENMP=0`` turns this off, and so does a fork: GNU OpenMP's threads are not
in a forked child, whose noise uses a new pool of its own. A team that runs nothing (the kernel
reports how far its chunks got) is given up for the pool (:func:`give_up`).
"""

import ctypes
import os
import threading
from typing import List, Optional

import torch

_lock = threading.Lock()
_found: Optional[List[Optional[int]]] = None  # [address] once looked up
_forked_child = False


def _forked() -> None:
    global _forked_child
    _forked_child = True


os.register_at_fork(after_in_child=_forked)


def gomp_parallel() -> Optional[int]:
    """The address of torch's ``GOMP_parallel``, or None (module doc); looked up once."""
    global _found
    if _forked_child:
        return None
    with _lock:
        if _found is None:
            _found = [_look_up()]
        return _found[0]


def give_up() -> None:
    """Use the pool from now on (the team found did not run the kernel)."""
    global _found
    with _lock:
        _found = [None]


def forget() -> None:
    """Look up again at the next call (after the environment changed)."""
    global _found
    with _lock:
        _found = None


def _look_up() -> Optional[int]:
    if os.environ.get("OPACUS_DP_NOISE_OPENMP", "1") == "0" or not hasattr(os, "RTLD_NOLOAD"):
        return None
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    path = _torch_libgomp()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        return ctypes.cast(library.GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _torch_libgomp() -> Optional[str]:
    """The path of the libgomp torch uses: the one in torch's ``lib`` directory, else the only one mapped."""
    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    libgomps = sorted(path for path in mapped if os.path.basename(path).startswith("libgomp"))
    torch_lib = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib")
    own = [path for path in libgomps if os.path.dirname(os.path.realpath(path)) == torch_lib]
    if own:
        return own[0]
    return libgomps[0] if len(libgomps) == 1 else None

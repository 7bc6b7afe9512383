"""Let glibc keep a private step's layer-sized tensors on its heap between steps (CPU, Linux).

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB in a fresh
process) with a new mapping, unmapped again on ``free``: every write to such a tensor faults once
per 4 KiB page. Each ``free`` of a mapping no larger than 32 MiB raises the threshold to that
mapping's size and the heap's trim threshold to twice it (mallopt(3), "dynamic mmap threshold"),
so a process that has freed one buffer of tens of MiB keeps smaller tensors on its heap and reuses
their pages. Non-private DDP gets there by itself (its gradient buckets); a private step, which
forms its sums and noised gradients outside them, did not: in a fresh process every clipped sum,
noised gradient and ``Adam`` temporary of every step was mapped and faulted in afresh (some
48 000 faults for a 16.8 M-parameter model, about as long as the rest of the step).

:func:`settle_heap_for` does, once per process, what any such program does: it frees one
untouched 28 MiB block (no page of it is ever written). The price is glibc's own: freed blocks
of up to 28 MiB, and up to 56 MiB of free space at the heap's top, stay mapped in the process for
its next allocations instead of going back to the system. Nothing else changes: a threshold
fixed by the user (``MALLOC_MMAP_THRESHOLD_``, ``mallopt``) turns the dynamic threshold off and
the free then changes nothing; off glibc, or where parameters are not on CPU, nothing is done.
"""

import ctypes
import sys
from typing import Iterable, Optional

import torch

SETTLING_BYTES = 28 << 20  # below glibc's 32 MiB cap with the alignment slack of any allocator on top
_settled = False  # tried (once per process)
_raised = False  # the block was freed: blocks up to SETTLING_BYTES now stay on the heap


def glibc() -> Optional[ctypes.CDLL]:
    """The process's C library if it is glibc (it exports ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc's own symbol, absent from musl and others
    except (OSError, AttributeError):
        return None
    return libc


def settle_heap() -> bool:
    """Raise glibc's dynamic mmap threshold once per process (module doc); True the first time it
    freed the block, False when already done or not on glibc."""
    global _settled, _raised
    if _settled:
        return False
    _settled = True
    libc = glibc()
    if libc is None:
        return False
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    block = libc.malloc(SETTLING_BYTES)
    if not block:
        return False
    libc.free(block)
    _raised = True
    return True


def keeps_blocks_of(nbytes: int) -> bool:
    """True where a freed block of ``nbytes`` stays on glibc's heap for the next one (the heap was
    settled here and the block is below the raised threshold): writing it again faults nothing."""
    return _raised and nbytes <= SETTLING_BYTES


def settle_heap_for(params: Iterable[torch.Tensor]) -> bool:
    """:func:`settle_heap` when any of ``params`` lives in CPU memory."""
    return any(p.device.type == "cpu" for p in params) and settle_heap()
